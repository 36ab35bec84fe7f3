"""KV cache bookkeeping (block ids, ref counts, block tables) and, in kv_tensors, the tensors.

Importing ``kvstore`` does not import torch; ``kvstore.kv_tensors`` does.
"""

from kvstore.block_pool import BlockPool, OutOfBlocksError
from kvstore.kv_manager import KVCacheManager, PrefixHit, blocks_for

__all__ = ["BlockPool", "KVCacheManager", "OutOfBlocksError", "PrefixHit", "blocks_for"]
