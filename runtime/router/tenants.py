"""A prefix cache per tenant: with API keys, the router gives each key's requests a cache salt
of their own (runtime/kvcache/radix.py), so that no tenant learns from a cache hit, a prefill's
speed or a block hash whether another one sent a prompt.

The salt is a MAC of the client's key and of the `cache_salt` the client sent, if any (which so
splits its own requests further, as in vLLM), under the cluster key (the same on every router
of a deployment, so a tenant's requests share KV whichever router they come through), or under
a secret of this process's when there is none. A client never sees it and cannot choose another
tenant's. Without API keys the client's own `cache_salt` is passed on as it is.
"""

from __future__ import annotations

import secrets

from runtime.auth.api_keys import ApiKeys, bearer
from runtime.auth.key import ClusterKey

PURPOSE = "cache-salt"


class TenantSalts:
    def __init__(self, keys: ApiKeys, cluster_key: ClusterKey) -> None:
        self.keys = keys
        self.secret = cluster_key if cluster_key.enabled else ClusterKey(secrets.token_bytes(32))

    def salt(self, authorization: str | None, client_salt: str | None) -> str | None:
        """The cache salt a request goes to the workers with."""
        if not self.keys.enabled:
            return client_salt
        mine = (client_salt or "").encode("utf-8", "surrogatepass")
        return self.secret.mac(PURPOSE, bearer(authorization).encode(), mine).hex()[:32]
