import numpy as np
import pytest
import torch

from kvstore.connector import layout
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace

NS = Namespace(model_id="m", num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", block_tokens=5)


def run(copies) -> None:
    for copy in copies:
        copy()


def random_kv(seq):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, seq, 4, generator=g), torch.randn(2, seq, 4, generator=g)) for _ in range(3)]


def test_pack_puts_layer_kv_token_head_dim_in_order():
    kv = random_kv(10)
    raw = np.zeros(2 * NS.block_nbytes, dtype=np.uint8)
    blocks = layout.block_view(NS, raw)
    run(layout.pack_copies(NS, kv, 0, raw))
    # block 1, layer 2, V, token 3, head 1 == V[head 1, token 5+3]
    assert torch.equal(blocks[1, 2, 1, 3, 1], kv[2][1][1, 8])
    assert torch.equal(blocks[0, 0, 0, :, 0], kv[0][0][0, 0:5])


def test_pack_then_unpack_is_identity_and_touches_only_its_tokens():
    kv = random_kv(15)
    raw = np.zeros(2 * NS.block_nbytes, dtype=np.uint8)
    run(layout.pack_copies(NS, kv, 1, raw))  # blocks 1 and 2
    out = [(torch.full((2, 15, 4), 7.0), torch.full((2, 15, 4), 7.0)) for _ in range(3)]
    run(layout.unpack_copies(NS, raw, 1, out))
    for (k, v), (ok, ov) in zip(kv, out):
        assert torch.equal(ok[:, 5:], k[:, 5:]) and torch.equal(ov[:, 5:], v[:, 5:])
        assert (ok[:, :5] == 7).all() and (ov[:, :5] == 7).all()  # unmapped tokens untouched


def test_bfloat16_views_without_numpy_support():
    ns = Namespace(model_id="m", num_layers=1, num_kv_heads=1, head_dim=2, dtype="bfloat16", block_tokens=2)
    kv = [(torch.randn(1, 2, 2).bfloat16(), torch.randn(1, 2, 2).bfloat16())]
    raw = np.zeros(ns.block_nbytes, dtype=np.uint8)
    run(layout.pack_copies(ns, kv, 0, raw))
    out = layout.empty_kv(ns, 2)
    run(layout.unpack_copies(ns, raw, 0, out))
    assert torch.equal(out[0][0], kv[0][0]) and torch.equal(out[0][1], kv[0][1])


@pytest.mark.parametrize("mangle,message", [
    (lambda kv: kv[:2], "expected 3 layers"),
    (lambda kv: [(k.half(), v) for k, v in kv], "dtype"),
    (lambda kv: [(k[:1], v) for k, v in kv], "shape"),
    (lambda kv: [(k,) for k, v in kv], "pair"),
])
def test_wrong_kv_is_refused_clearly(mangle, message):
    with pytest.raises(KVStoreError, match=message):
        layout.check_kv(NS, mangle(random_kv(10)), 10)


def test_read_groups_cover_every_block_once_in_order():
    from kvstore.connector.calls import groups as _groups

    assert _groups([10] * 7, 25) == [range(0, 3), range(3, 6), range(6, 7)]
    assert _groups([100, 1, 1], 25) == [range(0, 1), range(1, 3)]
    assert _groups([], 25) == []
