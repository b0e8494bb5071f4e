"""What the Gluon tensor-core decode kernels share (fp4_mma.py, fp8_mma.py, dense_mma.py). Imports Gluon: reached on
the GPU path only."""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .mma_choice import block_rows

# the CTA-wide barrier (Triton 3.5-3.6 name it thread_barrier, later versions barrier)
barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

SLICE = 128  # columns per loop step: four 32-column groups
SPLIT_TARGET = 528  # programs a launch aims at (four per SM of an H100/H200) when splitting K


def linear_plan(m: int, n: int, n2: int, k_steps: int) -> tuple[int, int, int, int, int]:
    """(tiles of the first weight, all tiles, K steps per split, splits, rows per program) of a tensor-core linear
    over 128-row weight tiles (a second weight's after the first's): the split follows from the weights alone, so a
    row's sums do not depend on m."""
    tiles1 = triton.cdiv(n, 128)
    tiles = tiles1 + triton.cdiv(n2, 128)
    per = triton.cdiv(k_steps, min(k_steps, max(1, triton.cdiv(SPLIT_TARGET, tiles))))
    return tiles1, tiles, per, triton.cdiv(k_steps, per), block_rows(m)


@gluon.constexpr_function
def activations_layout(rows):
    """A slice's activations of `rows` rows (8, 16 or 32) stored at common.mma_position, as [rows, 4 t, 4 groups,
    8 i]: lane 4 (row % 8) + t holds its 32 values of the slice, adjacent, for rows r, r + 8, ... (the B operand's
    columns as mma_v2 spreads them over its n-tiles)."""
    more = [[8 << j, 0, 0, 0] for j in range(int(rows).bit_length() - 4)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0]] + more,
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[0, 0, 0, 0], [0, 0, 0, 0]], block_bases=[], shape=[int(rows), 4, 4, 8])


# the MMA (m16n8k16, 4 warps along the weight rows) and its operands
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]))
A_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
B_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))


@gluon.jit
def wait_for_inputs():
    """launch.wait_for_inputs for Gluon kernels, which (3.6) have no grid-dependency ops: the same two instructions
    (offline sm_90: ACQBULK, PREEXIT, as Triton's gdc_wait and gdc_launch_dependents compile), so these kernels
    launch with PDL like the others. Non-pure, so it is kept though its result is unused."""
    gl.inline_asm_elementwise("griddepcontrol.wait;\ngriddepcontrol.launch_dependents;\nmov.u32 $0, 0;", "=r,r",
                              [gl.program_id(0)], gl.int32, False, 1)


@gluon.jit
def split_groups(t):
    """A slice's four 32-column groups on t's last two axes [2, 2] (group 2a + b at [a, b]) -> the four, in order."""
    even, odd = gl.split(t)
    g0, g2 = gl.split(even)
    g1, g3 = gl.split(odd)
    return g0, g1, g2, g3


@gluon.jit
def store_split(acc, out_ptr, part_ptr, count_ptr, r_c, n_c, M, N, pid_s, splits):
    """Store a program's accumulator [BN, BM] (rows r_c, columns n_c of a contiguous [M, N] output), or with
    several splits of K its partial, the last program of the (tile, row block) summing the partials in split order
    (the rows kernel's arrive-last scheme: a row's sum does not depend on which program arrives last)."""
    offs = r_c[None, :].to(gl.int64) * N + n_c[:, None]
    ok = (r_c < M)[None, :] & (n_c < N)[:, None]
    if splits == 1:
        gl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        gl.store(part_ptr + pid_s * M * N + offs, acc, mask=ok)
        barrier()
        counter = count_ptr + gl.program_id(0) * gl.num_programs(2) + gl.program_id(2)
        ticket = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            total = gl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                total += gl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0, cache_modifier=".cg")
            gl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)
