"""The KV page tiers below the device: host-cache sizing, the model fingerprint, and the
persistent disk page store. The core (Rust) decides which page is on which tier; this
package moves and keeps the bytes.
"""

from pagedrs.kv_tiers.disk_store import DiskPageStore, StoreGeometry
from pagedrs.kv_tiers.errors import CorruptPageError, DiskTierError, StoreBusyError
from pagedrs.kv_tiers.fingerprint import model_fingerprint
from pagedrs.kv_tiers.sizing import default_host_cache_gb, host_cache_blocks

__all__ = ["CorruptPageError", "DiskPageStore", "DiskTierError", "StoreBusyError", "StoreGeometry",
           "default_host_cache_gb", "host_cache_blocks", "model_fingerprint"]
