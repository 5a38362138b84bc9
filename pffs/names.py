"""The names in a session folder (contract §3), for code that needs no more of the manifest model."""

MANIFEST_NAME = "manifest.json"
PAGES_DIR = "pages"
