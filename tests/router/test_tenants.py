"""TenantSalts: one cache salt per API key (and client salt), the same on every router of a
deployment, none to choose."""

from __future__ import annotations

from runtime.auth.api_keys import ApiKeys
from runtime.auth.key import ClusterKey
from runtime.router.tenants import TenantSalts


def test_one_salt_per_key_and_client_salt_under_the_cluster_key() -> None:
    keys, cluster = ApiKeys(["sk-a", "sk-b"]), ClusterKey(b"k" * 32)
    one, other = TenantSalts(keys, cluster), TenantSalts(keys, cluster)  # two routers
    a = one.salt("Bearer sk-a", None)
    assert a == other.salt("Bearer sk-a", None) and a is not None and len(a) == 32
    assert len({a, one.salt("Bearer sk-b", None), one.salt("Bearer sk-a", "p2"),
                one.salt("Bearer sk-a", "\ud800")}) == 4  # (a lone surrogate is no 500)
    assert a != TenantSalts(keys, ClusterKey(b"j" * 32)).salt("Bearer sk-a", None)
    assert one.salt("Bearer sk-a", a) != a  # a client naming a salt gets another one
    no_keys = TenantSalts(ApiKeys(), cluster)
    assert no_keys.salt(None, None) is None and no_keys.salt(None, "mine") == "mine"
    keyless_router = TenantSalts(keys, ClusterKey.none())  # a secret of its own
    assert keyless_router.salt("Bearer sk-a", None) not in (None, a)
