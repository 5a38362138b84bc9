"""The mounted filesystem: thin pyfuse3 handlers over the namespace and the blob store."""
