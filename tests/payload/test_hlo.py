"""payload/backends/jax/hlo.py on hand-written programs in the compilers' text format, each
figure an exact number derived in the comments:
- PROGRAM (the TPU compiler's form): loops counted with their trip counts read off their
  conditions (a windowed einsum's two steps a trip included), a matmul written as a
  convolution with a padded window counted by the inputs it reads, a splash kernel by its
  own matmuls (its metadata continued over lines), all-gathers by dtype;
- CHUNK (a training chunk): the step loop (no trip count) holding a scan with XLA's
  `known_trip_count`: what is per step and what per call, collectives by kind, a Mosaic
  kernel's instances and runs;
- ASYNC: the async collectives (the TPU's start / continuation / done fusions of one
  all-gather, a combined `all-gather-start`, a `collective-permute-start`) each counted
  once with its results' bytes, and a conditional by its most expensive branch.
The compiled programs themselves: test_plan_memory.py (CPU), test_tpu_compile.py (the TPU
compiler, through `tpu-payload compile`) and bench/bench_tpu_compile.py."""

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


def test_trip_counts_from_conditions_padded_windows_and_a_splash_kernel() -> None:
    found = hlo.summarize(PROGRAM, causal=True)
    # The layer loop: i < 16 by 1 = 16 trips; the windowed loop: i < 8 by 2 = 4 trips. Both
    # have a trip count: no step loop, everything is per call.
    assert found.loops == [16, 4], found.loops  # (as the walk meets them)
    assert not found.step_loop
    dot = 2 * 4 * 16 * 8  # [4, 8] @ [8, 16]
    # The padded window reads one real input per output position: 2 x (b 2 x f 3 x 4
    # positions x 1 tap) x 8 input features (2 x 2 x 3 x 4 x 4 x 8 = 1,536 if all 16
    # (position, tap) pairs, the padding's included, were counted).
    window = 2 * (2 * 3 * 4 * 1) * 8
    assert (found.flops_per_call, found.flops_per_step) == (16 * (dot + 4 * window), 0)
    # splash forward: 2 matmuls of 2 x B x N x T x S x D, halved under the causal mask.
    splash = 2 * 2 * 2 * 4 * 256 * 256 * 16 // 2
    assert (found.kernel_flops_per_call, found.kernel_flops_per_step) == (splash, 0)
    assert found.total_flops() == 16 * (dot + 4 * window) + splash
    assert found.kernels == {"splash_mha_fwd_segmented_residuals": [1, 0, 1]}
    # bf16 weights gathered in every layer; the s32 token ids once.
    weights, ids = 16 * 8 * 16 * 2, 32 * 2048 * 4
    assert found.all_gathers_per_call == {"bf16": weights, "s32": ids}
    assert found.collectives_per_call == {"all-gather": [16 + 1, weights + ids]}
    assert found.collectives_per_step == found.all_gathers_per_step == {}
    # Without `causal`, the kernel's FLOPs are not counted (aot.py adds the plan's term).
    assert hlo.summarize(PROGRAM).kernel_flops_per_call is None
    assert "kernel_flops_per_call" not in hlo.summarize(PROGRAM).to_dict()


def test_a_loop_without_a_constant_bound_is_the_step_loop() -> None:
    found = hlo.summarize(PROGRAM.replace("constant(16)", "parameter(1)"), causal=False)
    assert found.step_loop and found.loops == [None, 4], found.loops
    # One layer per step; the window loop inside it keeps its 4 trips.
    assert (found.flops_per_step, found.flops_per_call) == (
        2 * 4 * 16 * 8 + 4 * 2 * (2 * 3 * 4) * 8,
        0,
    )
    assert found.all_gathers_per_step == {"bf16": 8 * 16 * 2}
    assert found.all_gathers_per_call == {"s32": 32 * 2048 * 4}
    # The kernel, outside the loop, runs once per call; no causal mask: not halved.
    assert found.kernel_flops_per_call == 2 * 2 * 2 * 4 * 256 * 256 * 16
    assert found.kernels == {"splash_mha_fwd_segmented_residuals": [1, 0, 1]}


# A step loop (no trip count) holding a scan of 4 (known trip count) that holds a dot, a
# fused convolution (the TPU's form of a dot), an all-gather per scan step and a Mosaic
# kernel; a dot outside the loop (once per call).
CHUNK = """HloModule jit_train_chunk, entry_computation_layout={()->()}

%fused_computation.1 (param_0: bf16[2,256,64], param_1: bf16[64,32,1]) -> bf16[2,256,32] {
  %param_0 = bf16[2,256,64]{2,1,0} parameter(0)
  %param_1 = bf16[64,32,1]{2,1,0} parameter(1)
  ROOT %convolution.7 = bf16[2,256,32]{1,2,0:T(8,128)(2,1)} convolution(%param_0, %param_1), window={size=1}, dim_labels=0bf_io0->0bf
}

%scan_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,16]{1,0} constant({...})
  %dot.3 = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %all-gather.9 = bf16[64,32]{1,0} all-gather(%w), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %a = bf16[2,256,64]{2,1,0} parameter(1)
  %fusion.2 = bf16[2,256,32]{2,1,0} fusion(%a, %all-gather.9), kind=kOutput, calls=%fused_computation.1
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %dot.3)
}

%scan_cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%step_body (q: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %q = (s32[], f32[8,16]{1,0}) parameter(0)
  %while.2 = (s32[], f32[8,16]{1,0}) while(%q), condition=%scan_cond, body=%scan_body, backend_config={"known_trip_count":{"n":"4"}}
  %k = bf16[2,4,256,16]{3,2,1,0} parameter(1)
  %splash_mha_fwd_residuals.1 = (f32[2,256,128]{2,1,0}) custom-call(%k), custom_call_target="tpu_custom_call", backend_config="..."
  %all-reduce.4 = f32[512]{0} all-reduce(%k), channel_id=2, to_apply=%add
  ROOT %r = (s32[], f32[8,16]{1,0}) tuple(%while.2)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main.5_spmd (arg: f32[8,16]) -> (s32[], f32[8,16]) {
  %arg = f32[8,16]{1,0} parameter(0)
  %v = f32[16,4]{1,0} constant({...})
  %dot.1 = f32[8,4]{1,0} dot(%arg, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %init = (s32[], f32[8,16]{1,0}) tuple(%arg)
  ROOT %while.9 = (s32[], f32[8,16]{1,0}) while(%init), condition=%scan_cond, body=%step_body
}
"""


def test_per_step_and_per_call_collectives_and_kernels_with_known_trip_counts() -> None:
    summary = hlo.summarize(CHUNK)
    dot = 2 * 8 * 16 * 16  # [8,16] x [16,16]
    convolution = 2 * (2 * 256 * 32) * 64  # out elements x the kernel's input features
    assert summary.step_loop and summary.loops == [None, 4]
    assert summary.flops_per_step == 4 * (dot + convolution)
    assert summary.flops_per_call == 2 * 8 * 4 * 16
    assert summary.collectives_per_step == {
        "all-gather": [4, 4 * 64 * 32 * 2],
        "all-reduce": [1, 512 * 4],
    }
    assert summary.all_gathers_per_step == {"bf16": 4 * 64 * 32 * 2}
    assert summary.collectives_per_call == {}
    assert summary.kernels == {"splash_mha_fwd_residuals": [1, 1, 0]}
    # No operand shapes on the kernel: counted, with 0 FLOPs, when asked for.
    assert hlo.summarize(CHUNK, causal=True).kernel_flops_per_step == 0
    # The step's body called once instead of looped (an evaluation step): all per call.
    once = CHUNK.replace(
        "while(%init), condition=%scan_cond, body=%step_body", "call(%init), to_apply=%step_body"
    )
    summary = hlo.summarize(once)
    assert not summary.step_loop and summary.flops_per_step == 0
    assert summary.flops_per_call == 2 * 8 * 4 * 16 + 4 * (dot + convolution)
    assert summary.collectives_per_call == {
        "all-gather": [4, 4 * 64 * 32 * 2],
        "all-reduce": [1, 512 * 4],
    }
    assert summary.kernels == {"splash_mha_fwd_residuals": [1, 0, 1]}


# The TPU compiler's async all-gather (channel 7): a start fusion (rooted at an
# AsyncCollectiveStart custom call), a continuation fusion overlapping it with a dot, and a
# done fusion (rooted at AsyncCollectiveDone), each with a copy of the all-gather; XLA's own
# async forms: a combined all-gather-start returning ((operands), (results)) and a
# collective-permute-start returning (operand, result, context); a conditional whose
# branches do 2 and 1 dots.
ASYNC = """HloModule jit_async, entry_computation_layout={()->()}

%start_fusion (param_0: bf16[2,16]) -> (bf16[2,16], bf16[8,16], u32[]) {
  %param_0 = bf16[2,16]{1,0:T(2,128)(2,1)} parameter(0)
  %all-gather.1 = bf16[8,16]{1,0:T(8,128)(2,1)} all-gather(%param_0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %custom-call.1 = (bf16[2,16]{1,0:T(2,128)(2,1)}, bf16[8,16]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.1 (param_0.1: bf16[2,16], param_1.1: f32[4,16], param_2.1: f32[16,16]) -> (f32[4,16], bf16[8,16]) {
  %param_0.1 = bf16[2,16]{1,0} parameter(0)
  %param_1.1 = f32[4,16]{1,0} parameter(1)
  %param_2.1 = f32[16,16]{1,0} parameter(2)
  %dot.1 = f32[4,16]{1,0} dot(%param_1.1, %param_2.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %all-gather.2 = bf16[8,16]{1,0} all-gather(%param_0.1), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %tuple.1 = (f32[4,16]{1,0}, bf16[8,16]{1,0}) tuple(%dot.1, %all-gather.2)
}

%done_fusion (param_0.2: bf16[2,16]) -> bf16[8,16] {
  %param_0.2 = bf16[2,16]{1,0} parameter(0)
  %all-gather.3 = bf16[8,16]{1,0} all-gather(%param_0.2), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %custom-call.3 = bf16[8,16]{1,0} custom-call(%all-gather.3), custom_call_target="AsyncCollectiveDone"
}

%two_dots (a.4: f32[4,16], b.4: f32[16,16]) -> f32[4,16] {
  %a.4 = f32[4,16]{1,0} parameter(0)
  %b.4 = f32[16,16]{1,0} parameter(1)
  %dot.4 = f32[4,16]{1,0} dot(%a.4, %b.4), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %dot.5 = f32[4,16]{1,0} dot(%dot.4, %b.4), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%one_dot (a.6: f32[4,16], b.6: f32[16,16]) -> f32[4,16] {
  %a.6 = f32[4,16]{1,0} parameter(0)
  %b.6 = f32[16,16]{1,0} parameter(1)
  ROOT %dot.6 = f32[4,16]{1,0} dot(%a.6, %b.6), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[2,16], x: f32[4,16], v: f32[16,16], s: f32[1,4], p: pred[]) -> f32[4,16] {
  %w = bf16[2,16]{1,0} parameter(0)
  %x = f32[4,16]{1,0} parameter(1)
  %v = f32[16,16]{1,0} parameter(2)
  %s = f32[1,4]{1,0} parameter(3)
  %p = pred[] parameter(4)
  %start = (bf16[2,16]{1,0}, bf16[8,16]{1,0}, u32[]) fusion(%w), kind=kCustom, calls=%start_fusion
  %overlap = (f32[4,16]{1,0}, bf16[8,16]{1,0}) fusion(%w, %x, %v), kind=kCustom, calls=%async_collective_fusion.1
  %done = bf16[8,16]{1,0} fusion(%w), kind=kCustom, calls=%done_fusion
  %ags = ((bf16[2,16]{1,0}, f32[1,4]{1,0}), (bf16[8,16]{1,0}, f32[4,4]{1,0})) all-gather-start(%w, %s), channel_id=8, replica_groups=[1,4]<=[4], dimensions={0}
  %agd = (bf16[8,16]{1,0}, f32[4,4]{1,0}) all-gather-done(%ags)
  %cps = (f32[1,4]{1,0}, f32[1,4]{1,0}, u32[], u32[]) collective-permute-start(%s), channel_id=9, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[1,4]{1,0} collective-permute-done(%cps)
  ROOT %branch = f32[4,16]{1,0} conditional(%p, %x, %x), true_computation=%two_dots, false_computation=%one_dot
}
"""


def test_async_collectives_count_once_with_their_results_and_a_conditional_its_costliest_branch() -> (
    None
):
    summary = hlo.summarize(ASYNC)
    gathered = 8 * 16 * 2  # one bf16[8,16], counted in the done fusion only (not 3 x)
    combined = {"bf16": 8 * 16 * 2, "f32": 4 * 4 * 4}  # the start's results, not its operands
    assert summary.all_gathers_per_call == {"bf16": gathered + combined["bf16"], "f32": 64}
    assert summary.collectives_per_call == {
        "all-gather": [2, gathered + sum(combined.values())],
        "collective-permute": [1, 1 * 4 * 4],  # the result, not operand + result + context
    }
    dot = 2 * 4 * 16 * 16  # [4,16] x [16,16]
    # The continuation's dot, and the conditional's two-dot branch (one branch runs).
    assert summary.flops_per_call == dot + 2 * dot
    assert not summary.step_loop and summary.loops == [] and summary.kernels == {}


def test_state_the_step_loop_carries_in_another_layout_than_the_arguments() -> None:
    """hlo.relaid_state: the step loop's arrays whose layout (memory space aside) no result
    of their shape has; without an entry layout in the text: 0."""
    assert hlo.summarize(CHUNK).relaid_state == 0
    laid = CHUNK.replace(
        "entry_computation_layout={()->()}",
        "entry_computation_layout={(f32[8,16]{1,0:T(8,128)})->(s32[], f32[8,16]{1,0:T(8,128)})}",
    )

    def carried(layout: str) -> str:
        return laid.replace(
            "ROOT %while.9 = (s32[], f32[8,16]{1,0})",
            f"ROOT %while.9 = (s32[]{{:T(128)}}, f32[8,16]{{{layout}}})",
        )

    assert hlo.summarize(carried("1,0:T(8,128)S(1)")).relaid_state == 0  # in VMEM: same layout
    assert hlo.summarize(carried("0,1:T(8,128)")).relaid_state == 1


def test_the_compilers_out_of_memory_message_is_one_line() -> None:
    error = RuntimeError(
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
        "space hbm. Used 20.84G of 15.75G hbm. Exceeded hbm capacity by 5.09G.\n\n"
        "Total hbm usage >= 21.09G:\n    reserved 263.00M\n    program 20.84G\n"
    )
    line = hlo.out_of_memory(error)
    assert line is not None and "\n" not in line
    assert "Used 20.84G of 15.75G hbm" in line
    assert hlo.out_of_memory(ValueError("q_block_size=512 should divide q_seq_len=640")) is None
