"""payload/backends/jax/hlo.py on a hand-written program in the TPU compiler's text format:
loops counted with their trip counts (a windowed einsum's two steps a trip included), a
matmul written as a convolution with a padded window counted by the inputs it reads, a
splash kernel by its own matmuls (its metadata continued over lines), all-gathers by dtype.
The compiled programs themselves: test_plan_memory.py (CPU) and bench/bench_tpu_compile.py
(TPU)."""

# ruff: noqa: E501  (HLO instructions are one line each, as long as the compiler writes them)

from __future__ import annotations

from payload.backends.jax import hlo

PROGRAM = """\
HloModule jit_step, entry_computation_layout={()->f32[]}

%layer_cond (p.0: (s32[], bf16[4,8])) -> pred[] {
  %p.0 = (s32[]{:T(128)}, bf16[4,8]{1,0}) parameter(0)
  %i.0 = s32[]{:T(128)} get-tuple-element(%p.0), index=0
  %limit.0 = s32[]{:T(128)} constant(16)
  ROOT %lt.0 = pred[]{:T(512)} compare(%i.0, %limit.0), direction=LT
}

%fused_dot (param_0.1: bf16[4,8], param_1.1: bf16[8,16]) -> bf16[4,16] {
  %param_0.1 = bf16[4,8]{1,0} parameter(0)
  %param_1.1 = bf16[8,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4,16]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%window_cond (p.2: (u32[], bf16[2,1,8])) -> pred[] {
  %p.2 = (u32[]{:T(128)}, bf16[2,1,8]{2,1,0}) parameter(0)
  %i.2 = u32[]{:T(128)} get-tuple-element(%p.2), index=0
  %limit.2 = u32[]{:T(128)} constant(8)
  ROOT %lt.2 = pred[]{:T(512)} compare(%i.2, %limit.2), direction=LT
}

%window_body (p.3: (u32[], bf16[2,1,8])) -> (u32[], bf16[2,1,8]) {
  %p.3 = (u32[]{:T(128)}, bf16[2,1,8]{2,1,0}) parameter(0)
  %i.3 = u32[]{:T(128)} get-tuple-element(%p.3), index=0
  %two.3 = u32[]{:T(128)} constant(2)
  %next.3 = u32[]{:T(128)} add(%i.3, %two.3)
  %x.3 = bf16[2,1,8]{2,1,0} get-tuple-element(%p.3), index=1
  %w.3 = bf16[4,3,8]{2,1,0} constant({...})
  %conv.3 = bf16[2,4,3]{2,1,0} convolution(%x.3, %w.3), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=b0f_0oi->b0f, metadata={op_name="dot_general"}
  ROOT %tuple.3 = (u32[]{:T(128)}, bf16[2,1,8]{2,1,0}) tuple(%next.3, %x.3)
}

%layer_body (p.1: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p.1 = (s32[]{:T(128)}, bf16[4,8]{1,0}) parameter(0)
  %i.1 = s32[]{:T(128)} get-tuple-element(%p.1), index=0
  %one.1 = s32[]{:T(128)} constant(1)
  %next.1 = s32[]{:T(128)} add(%i.1, %one.1)
  %x.1 = bf16[4,8]{1,0} get-tuple-element(%p.1), index=1
  %w.1 = bf16[8,16]{1,0} constant({...})
  %fusion.1 = bf16[4,16]{1,0} fusion(%x.1, %w.1), kind=kOutput, calls=%fused_dot
  %gathered.1 = bf16[8,16]{1,0} all-gather(%w.1), dimensions={0}
  %zero.1 = u32[]{:T(128)} constant(0)
  %y.1 = bf16[2,1,8]{2,1,0} constant({...})
  %start.1 = (u32[]{:T(128)}, bf16[2,1,8]{2,1,0}) tuple(%zero.1, %y.1)
  %window.1 = (u32[]{:T(128)}, bf16[2,1,8]{2,1,0}) while(%start.1), condition=%window_cond, body=%window_body
  ROOT %tuple.1 = (s32[]{:T(128)}, bf16[4,8]{1,0}) tuple(%next.1, %x.1)
}

ENTRY %main (q.9: bf16[2,4,256,16], k.9: bf16[2,2,256,16]) -> f32[] {
  %q.9 = bf16[2,4,256,16]{3,2,1,0} parameter(0)
  %k.9 = bf16[2,2,256,16]{3,2,1,0} parameter(1)
  %zero.9 = s32[]{:T(128)} constant(0)
  %x.9 = bf16[4,8]{1,0} constant({...})
  %start.9 = (s32[]{:T(128)}, bf16[4,8]{1,0}) tuple(%zero.9, %x.9)
  %layers.9 = (s32[]{:T(128)}, bf16[4,8]{1,0}) while(%start.9), condition=%layer_cond, body=%layer_body
  %splash_mha_fwd_segmented_residuals.9 = (bf16[2,4,256,16]{3,2,1,0}, f32[2,4,256,128]{3,2,1,0}) custom-call(%q.9, %k.9, %k.9), custom_call_target="tpu_custom_call", operand_layout_constraints={bf16[2,4,256,16]{3,2,1,0}, bf16[2,2,256,16]{3,2,1,0}, bf16[2,2,256,16]{3,2,1,0}}, frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 256}"
}}, metadata={op_name="pallas_call"}
  %ids.9 = s32[32,2048]{1,0} all-gather(%zero.9), dimensions={0}
  ROOT %out.9 = f32[]{:T(128)} constant(0)
}
"""


def test_flops_loops_kernels_and_gathers() -> None:
    found = hlo.analyse_program(PROGRAM, causal=True)
    # (body, trips): the layer loop 16 trips; the windowed loop 8 / 2 per trip = 4.
    assert sorted(trips for _, trips in found.loops) == [4, 16], found.loops
    dot = 2 * 4 * 16 * 8  # [4, 8] @ [8, 16]
    # The padded window reads one real input per output position: 2 x 4 x 3 x 8 multiplies.
    window = 2 * (2 * 4 * 3) * 8
    # splash forward: 2 matmuls of 2 x B x N x T x S x D, halved under the causal mask.
    splash = 2 * 2 * 2 * 4 * 256 * 256 * 16 / 2
    assert found.flops == 16 * (dot + 4 * window) + splash, found.flops
    assert found.kernels == {"splash_mha_fwd": 1}
    # bf16 weights gathered in every layer; the s32 token ids once.
    assert found.all_gathers == {"bf16": 16 * 8 * 16 * 2, "s32": 32 * 2048 * 4}


def test_a_loop_without_a_constant_bound_counts_once() -> None:
    program = PROGRAM.replace("constant(16)", "parameter(1)")
    found = hlo.analyse_program(program)
    assert sorted(trips is None for _, trips in found.loops) == [False, True]
