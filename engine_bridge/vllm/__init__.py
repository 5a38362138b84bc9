"""vLLM's way in: a KV connector that saves a request's KV as a pffs session
by name and starts a request from one (``docs/engines.md``).

Load it with ``--kv-transfer-config '{"kv_connector": "PffsConnector",
"kv_connector_module_path": "engine_bridge.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"root": "/mnt/kvcache"}}'``.
"""

from engine_bridge.vllm.connector import PffsConnector, PffsConnectorMetadata

__all__ = ["PffsConnector", "PffsConnectorMetadata"]
