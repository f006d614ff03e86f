"""Engine side: look up, load and save KV of token prefixes.

    from kvstore.connector import KVStoreClient, Namespace
"""

from kvstore.connector.client import KVStoreClient
from kvstore.core.keys import Namespace

__all__ = ["KVStoreClient", "Namespace"]
