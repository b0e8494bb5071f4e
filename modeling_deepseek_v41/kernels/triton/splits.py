"""Split-K bookkeeping shared by the decode kernels: each program of a weight tile stores its split's partial sums,
the last to arrive sums them in split order in the same launch (deterministic, no second launch), and the pairing
of two linears on one input in one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def arrive_last(count_ptr, tile, splits):
    """Whether this program is the last of the `splits` programs sharing `tile` to have stored its partial sums:
    that one adds them up in split order (deterministic) in the same launch, and sets the count back to zero for
    the next launch (workspace.arrival_counts: the counts are zero at launch)."""
    tl.debug_barrier()  # every thread's partial stores come before the arrival is counted
    ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = ticket == splits - 1
    if last:
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def pair_operands(pid_n, tiles1, w_ptr, s_ptr, out_ptr, stride_om, N, w2_ptr, s2_ptr, out2_ptr, stride_o2m, N2):
    """A pair of linears in one launch: a program past the first weight's `tiles1` column tiles takes the second's
    (weight, scales, output, output row stride, first column in the partials, column tile, N)."""
    second = pid_n >= tiles1
    return (tl.where(second, w2_ptr, w_ptr), tl.where(second, s2_ptr, s_ptr), tl.where(second, out2_ptr, out_ptr),
            tl.where(second, stride_o2m, stride_om), tl.where(second, N, 0), tl.where(second, pid_n - tiles1, pid_n),
            tl.where(second, N2, N))


@triton.jit
def sum_partials(part_ptr, offs, mask, splits, stride_split):
    """sum over s of part[s * stride_split + offs] in fp32, s ascending; read through L2 (other programs wrote them).
    Four splits' loads are issued before they are added, so the last program waits for one L2 round trip per four
    splits rather than per split (a split past `splits` adds -0.0, the exact identity of fp32 addition)."""
    total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for s0 in range(1, splits, 4):
        later = offs * 0 + s0
        p1 = tl.load(part_ptr + s0 * stride_split + offs, mask=mask, other=0.0, cache_modifier=".cg")
        p2 = tl.load(part_ptr + (s0 + 1) * stride_split + offs, mask=mask & (later + 1 < splits), other=-0.0,
                     cache_modifier=".cg")
        p3 = tl.load(part_ptr + (s0 + 2) * stride_split + offs, mask=mask & (later + 2 < splits), other=-0.0,
                     cache_modifier=".cg")
        p4 = tl.load(part_ptr + (s0 + 3) * stride_split + offs, mask=mask & (later + 3 < splits), other=-0.0,
                     cache_modifier=".cg")
        total = (((total + p1) + p2) + p3) + p4
    return total
