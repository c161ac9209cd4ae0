"""The block mask (fagen.create_block_mask): block classes from the generated kernel against an elementwise
evaluation of the user's own mask_mod (the float64 reference's), its coarsening and its block lists."""

import pytest
import torch
from _env import DEVICE

from fagen.bench import gym_mods as g
from fagen.runtime.block_mask import create_block_mask
from fagen.verify.mods_reference import mask_mod_visible


def _classes(visible: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """0/1/2 per block from a bool [B, H, Sq, Sk]: elements past the sequences do not count."""
    b, h, sq, sk = visible.shape
    qb, kb = -(-sq // bm), -(-sk // bn)
    out = torch.empty(b, h, qb, kb, dtype=torch.int8, device=visible.device)
    for i in range(qb):
        for j in range(kb):
            tile = visible[:, :, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].flatten(2)
            out[:, :, i, j] = torch.where(~tile.any(-1), 0, torch.where(tile.all(-1), 2, 1))
    return out


def _doc():
    offsets = g.length_to_offsets([37, 60, 3, 97], DEVICE)
    return g.generate_doc_mask_mod(g.causal_mask, offsets), 1, 1


def _per_head():
    # a captured int tensor read at [b, h], drawn on the CPU: the same values on every device (the tests' asserts
    # about the rows' variety hold for these draws; CUDA's generator gave two distinct work values on the H200)
    starts = torch.randint(0, 90, (2, 3), dtype=torch.int64).to(DEVICE)

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx >= starts[b, h]) | (q_idx % 7 == kv_idx % 7)
    return mask, 2, 3


CASES = {
    "document+causal": _doc,
    "sliding_window": lambda: (g.generate_sliding_window(21), 1, 1),
    "prefix_lm": lambda: (g.generate_prefix_lm_mask(45), 1, 1),
    "dilated": lambda: (g.generate_dilated_sliding_window(40, 3), 1, 1),
    "per_head_tensor": _per_head,
    "constant": lambda: ((lambda b, h, q_idx, kv_idx: q_idx >= 0), 1, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_classes_match_the_elementwise_mask(case):
    torch.manual_seed(0)
    mask, nb, nh = CASES[case]()
    sq, sk = 197, 150  # not multiples of the block
    bm = create_block_mask(mask, nb, nh, sq, sk, device=DEVICE, block_size=32)
    want = _classes(mask_mod_visible(mask, nb, nh, sq, sk, DEVICE), 32, 32)
    assert bm.classes.shape == want.shape
    assert torch.equal(bm.classes, want), case
    coarse = bm.at(64, 128)
    assert torch.equal(coarse.classes, _classes(mask_mod_visible(mask, nb, nh, sq, sk, DEVICE), 64, 128))
    num, idx = bm.kv_lists()
    for i in range(want.shape[2]):
        nonempty = (want[0, 0, i] != 0).nonzero().flatten().to(torch.int32)
        assert num[0, 0, i] == len(nonempty) and torch.equal(idx[0, 0, i, :len(nonempty)], nonempty)
    qnum, _ = bm.q_lists()
    assert torch.equal(qnum, (want != 0).sum(-2, dtype=torch.int32))


def test_a_mask_without_b_or_h_is_evaluated_once_and_none_broadcasts():
    bm = create_block_mask(g.causal_mask, None, None, 64, 64, device=DEVICE, block_size=16)
    assert bm.shape == (1, 1, 4, 4)
    assert torch.equal(bm.classes[0, 0].cpu(), torch.tensor([[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]],
                                                            dtype=torch.int8))
    mask, _, _ = _per_head()
    with pytest.raises(ValueError, match="reads b; pass B"):
        create_block_mask(mask, None, 3, 64, 64, device=DEVICE)


@pytest.mark.parametrize("case", ["document+causal", "per_head_tensor"])
def test_the_forward_lists_end_with_each_b_rows_heaviest_first(case):
    """[Note] Work order: entry 4n + 2 of the forward lists' flat rows (h' * QB + query block) of each b' is a
    permutation of them, by descending work (3 per partial block, 2 per full one, 2 per row), ties ascending."""
    torch.manual_seed(0)
    mask, nb, nh = CASES[case]()
    bm = create_block_mask(mask, nb, nh, 197, 150, device=DEVICE, block_size=32)
    cls, lists, lists_t, gm, gn = bm.kernel_form(DEVICE, 32, 32)
    b, h, qb, kb = cls.shape
    assert lists.shape == (b, h, qb, 4 * kb + 3) and lists_t.shape == (b, h, kb, 4 * qb + 2)
    work = (3 * (cls == 1).sum(-1) + 2 * (cls == 2).sum(-1) + 2).flatten(1).tolist()
    for i in range(b):
        order = lists[i, ..., 4 * kb + 2].flatten().tolist()
        assert sorted(order) == list(range(h * qb))
        assert order == sorted(range(h * qb), key=lambda r: (-work[i][r], r))
    assert len(set(work[0])) > 2  # the rows differ: the order is not the identity by accident
