"""The scripts under scripts/ compute what they claim to measure (run here under Triton's interpreter)."""

from __future__ import annotations

import argparse
import csv

import pytest
import torch

from ._scripts import load_script


def test_autograd_split_times_each_stretch_and_puts_the_launchers_back(capsys):
    # bench_host_overhead.py --autograd-split patches the autograd.Function's backward and the backward it calls to
    # time them, and on a machine without a GPU turns launches into no-ops: afterwards all three are the real ones.
    from fa2tune.launch import autograd, layout

    script = load_script("bench_host_overhead")
    before = (autograd.EagerAttention.backward, autograd.backward, layout.kernel)
    assert script._autograd_split(5) == 0
    assert (autograd.EagerAttention.backward, autograd.backward, layout.kernel) == before
    lines = capsys.readouterr().out.splitlines()
    spans = {line.rsplit(maxsplit=1)[0].strip(): float(line.rsplit(maxsplit=1)[1]) for line in lines[1:]}
    assert len(spans) == 7 and all(us > 0 for us in spans.values())  # every stamp taken, each after the one before


def test_host_time_of_a_burst_is_the_median_bursts_per_call_time(monkeypatch):
    # bench_host_overhead.py --waits: host µs a call = a burst's time over its calls, the median of the bursts — here
    # with a call whose cost the test sets (a fake clock), so the reading is known: bursts of 4 calls at 10, 30 and
    # 20 µs a call read 20. Without a GPU no sleep kernel is queued, and --waits says it needs one.
    script = load_script("bench_host_overhead")
    clock = {"now": 0.0}
    costs = iter([10e-6] * 4 + [30e-6] * 4 + [20e-6] * 4)
    made = []

    def call():
        made.append(1)
        clock["now"] += next(costs)

    monkeypatch.setattr(script.time, "perf_counter", lambda: clock["now"])
    assert script._host_us(call, calls=4, rounds=3) == pytest.approx(20.0)
    assert len(made) == 12
    if not torch.cuda.is_available():
        assert script._waits() == 2


_SASS_LOOP = """
        /*0100*/                   LDSM.16.M88.4 R152, [R187+0xe000] ;                  /* 0x0 */
        /*0200*/                   WARPGROUP.ARRIVE ;                                    /* 0x0 */
        /*0210*/                   HGMMA.64x64x16.F32.BF16 R24, R152, gdesc[UR16], RZ, !UPT ;   /* 0x0 */
        /*0220*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                       /* 0x0 */
        /*0230*/                   MUFU.EX2 R40, R24 ;                                   /* 0x0 */
        /*0240*/                   F2FP.BF16.F32.PACK_AB {ptile}, R41, R40 ;             /* 0x0 */
        /*0250*/                   HGMMA.64x64x16.F32.BF16 R88, {ptile}, gdesc[UR28].tnspB, R88 ;   /* 0x0 */
        /*0260*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;                     /* 0x0 */
        /*0270*/               @P0 BRA 0x200 ;                                           /* 0x0 */
"""


def test_sass_check_finds_a_register_operand_rewritten_inside_its_loop():
    # scripts/sass_wgmma_operands.py: K, loaded before the loop, is the first HGMMA's register operand on every step;
    # Pᵀ is formed in the loop before its own HGMMA. Put Pᵀ in K's registers (what an sm_90 compile can do with the
    # causal mask under a branch) and the check names the instruction; in registers of its own, nothing is reported.
    script = load_script("sass_wgmma_operands")
    (bad,) = script.innermost_hgmma_loops(script.parse(_SASS_LOOP.format(ptile="R152")))
    assert (bad.start, bad.end, bad.hgmmas) == (0x200, 0x270, 2)
    assert bad.clobbers == ("F2FP.BF16.F32.PACK_AB R152, R41, R40",) and bad.operand_registers == (152,)
    (good,) = script.innermost_hgmma_loops(script.parse(_SASS_LOOP.format(ptile="R60")))
    assert good.clobbers == () and good.operand_registers == (60, 152) and good.spills == 0


# A pipelined step at a head dim of two V chunks (d=192): the step before's P, carried in, feeds the second chunk's
# P·V, then this step's P replaces it and feeds both chunks' — as compiled, the loop may begin between the two reads.
_SASS_TWO_CHUNKS = """
        /*0200*/                   WARPGROUP.ARRIVE ;                                    /* 0x0 */
        /*0210*/                   HGMMA.64x64x16.F32.BF16 R88, R60, gdesc[UR28].tnspB, R88 ;   /* 0x0 */
        /*0220*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                       /* 0x0 */
        /*0230*/                   MUFU.EX2 R40, R24 ;                                   /* 0x0 */
        /*0240*/                   F2FP.BF16.F32.PACK_AB R60, R41, R40 ;                 /* 0x0 */
        /*0250*/                   HGMMA.64x128x16.F32.BF16 R120, R60, gdesc[UR24].tnspB, R120 ;  /* 0x0 */
        /*0260*/                   HGMMA.64x64x16.F32.BF16 {acc}, R60, gdesc[UR28].tnspB, {acc} ;   /* 0x0 */
        /*0270*/               @P0 BRA 0x200 ;                                           /* 0x0 */
"""


def test_sass_check_takes_one_operand_feeding_each_head_dim_chunk_for_no_rewrite():
    # the same P read by the same matmuls before and after its rewrite is the step's value replaced by the next
    # step's, not an operand meant to last the loop given to another matmul (which the test above finds)
    script = load_script("sass_wgmma_operands")
    (loop,) = script.innermost_hgmma_loops(script.parse(_SASS_TWO_CHUNKS.format(acc="R88")))
    assert loop.hgmmas == 3 and loop.operand_registers == (60,) and loop.clobbers == ()
    # given only to matmuls that did not read it before the write, it is reported
    (bad,) = script.innermost_hgmma_loops(script.parse(_SASS_TWO_CHUNKS.format(acc="R24")))
    assert bad.clobbers == ("F2FP.BF16.F32.PACK_AB R60, R41, R40",)


_SASS_STEP = """
        /*0100*/                   MOV R1, R2 ;                                          /* 0x0 */
        /*0200*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ; /* 0x0 */
        /*0210*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;        /* 0x0 */
        /*0220*/              @!P0 BRA 0x210 ;                                           /* 0x0 */
        /*0230*/              @!P2 BRA P1, 0x{target} ;                                  /* 0x0 */
{mask}
        /*0400*/                   FMNMX R40, R24, R25, !PT ;                            /* 0x0 */
        /*0410*/                   MUFU.EX2 R41, R40 ;                                   /* 0x0 */
        /*0420*/                   HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR24].tnspB, R88 ;  /* 0x0 */
        /*0430*/               @P3 BRA 0x200 ;                                           /* 0x0 */
"""


def test_step_mix_counts_a_step_and_the_mask_block_a_branch_skips():
    # scripts/sass_step_mix.py: the step loop is the innermost loop with HGMMAs and MUFU.EX2 — not
    # the mbarrier's spin loop inside it —, and the mask block behind the two-predicate branch sm_90 writes
    # ("@!P2 BRA P1, target") is what an unmasked step does not issue; a branch over a few instructions is control.
    script = load_script("sass_step_mix")
    mask = "\n".join(f"        /*{0x240 + 16 * i:04x}*/ FSEL R{24 + i}, R{24 + i}, -INF , !P4 ;  /* 0x0 */"
                     for i in range(20))  # fmt: skip
    loop = script.step_loop(script.parse(_SASS_STEP.format(target="0400", mask=mask)), min_exp2=1)
    assert (loop.start, loop.end, loop.instructions) == (0x200, 0x430, 28)
    assert loop.opcodes["HGMMA"] == 2 and loop.opcodes["MUFU"] == 1 and loop.opcodes["FSEL"] == 20
    assert [(b, t, ops["FSEL"]) for b, t, ops in loop.skipped] == [(0x230, 0x400, 20)] and loop.unmasked == 8
    short = script.step_loop(script.parse(_SASS_STEP.format(target="0400", mask=mask.split("\n", 19)[-1])), min_exp2=1)
    assert short.skipped == () and short.unmasked == short.instructions == 9
    without_exp2 = _SASS_STEP.replace("MUFU.EX2 R41, R40", "FADD R41, R40, R40")
    assert script.step_loop(script.parse(without_exp2.format(target="0400", mask=mask)), min_exp2=1) is None
    assert script.step_loop(script.parse(_SASS_STEP.format(target="0400", mask=mask))) is None  # 1 exp2: not a softmax


def test_step_mix_counts_one_block_of_an_if_else_as_skipped():
    # The forward computes its softmax in a masked and an unmasked copy — an if/else, whose first block ends with a
    # branch over the second. A step runs one of them, so an unmasked step is the loop less the
    # larger (the masked copy), not less both.
    script = load_script("sass_step_mix")
    lines = ["/*0200*/ HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ;", "/*0210*/ @!P2 BRA 0x0400 ;"]
    lines += [f"/*{0x220 + 16 * i:04x}*/ FSEL R{24 + i}, R{24 + i}, -INF , !P4 ;" for i in range(29)]
    lines += ["/*03f0*/ BRA 0x0500 ;"]
    lines += [f"/*{0x400 + 16 * i:04x}*/ FMUL R{24 + i}, R{24 + i}, R2 ;" for i in range(16)]
    lines += ["/*0500*/ MUFU.EX2 R41, R40 ;", "/*0510*/ @P3 BRA 0x200 ;"]
    loop = script.step_loop(script.parse("\n".join(f"        {x}  /* 0x0 */" for x in lines)), min_exp2=1)
    assert [(b, t) for b, t, _ in loop.skipped] == [(0x210, 0x400), (0x3F0, 0x500)]
    assert loop.instructions == 50 and loop.unmasked == 50 - 30  # the FSEL block and its branch over the FMULs
    assert loop.unmasked_opcodes["FMUL"] == 16 and loop.unmasked_opcodes["FSEL"] == 0


def test_step_mix_says_where_the_step_waits_for_its_wgmmas_against_its_exponentials():
    # ptxas may put the forward's wait for no wgmma in flight ahead of the softmax. The report gives each wait's
    # address and groups left in flight, and the exponentials' span.
    script = load_script("sass_step_mix")
    waits = (
        "        /*03e0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                     /* 0x0 */\n"
        "        /*03f0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                     /* 0x0 */"
    )
    instructions = script.parse(_SASS_STEP.format(target="03e0", mask=waits))
    loop = script.step_loop(instructions, min_exp2=1)
    assert script.wait_placement(instructions, loop) == ([(0x3E0, 1), (0x3F0, 0)], 0x410, 0x410)
    wait_after = "        /*0428*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;  /* 0x0 */\n"
    after = _SASS_STEP.replace("        /*0430*/", wait_after + "        /*0430*/")
    instructions = script.parse(after.format(target="0400", mask=""))
    loop = script.step_loop(instructions, min_exp2=1)
    assert script.wait_placement(instructions, loop) == ([(0x428, 0)], 0x410, 0x410)


def test_restamp_lists_stale_entries_and_rewrites_only_their_hash_lines(tmp_path, capsys):
    # scripts/restamp_configs.py: an entry whose template_hash is not the current code's is listed; --write gives it
    # the current hash and changes no other line of the file (comments, order, the fresh entry); then none is stale.
    from fa2tune.config import store
    from fa2tune.config.types import KernelConfig
    from fa2tune.kernels import codegen

    script = load_script("restamp_configs")
    cfg = KernelConfig(64, 64, 4, 2)

    def entry(causal, template_hash):
        return store.Entry(key=store.EntryKey(head_dim=64, dtype="fp16", causal=causal, kernel="fwd"), config=cfg,
                           ms=1.0, tflops=1.0, baseline=None, trials=1, spread=0.0, triton_version="3.6.0",
                           torch_version="2.13.0", template_hash=template_hash, date="2026-11-30")  # fmt: skip

    path = tmp_path / "gpu.yaml"
    fresh = codegen.entry_code_hash(entry(False, "x").key, cfg)
    store.write_entries(path, {"name": "gpu"}, [entry(False, fresh), entry(True, "00000000deadbeef")])
    path.write_text("# shipped configs\n" + path.read_text())
    before = path.read_text()
    assert script.main([str(path)]) == 0
    assert path.read_text() == before
    assert "stale fwd d=64 fp16 causal=True all: 64x64 w4 s2" in capsys.readouterr().out
    assert script.main([str(path), "--write"]) == 0
    assert f"python scripts/audit_entries.py {path}" in capsys.readouterr().out  # the configs kept: check them
    after = path.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    current = codegen.entry_code_hash(entry(True, "x").key, cfg)
    assert changed == [("  template_hash: 00000000deadbeef", f"  template_hash: {current}")]
    assert after.startswith("# shipped configs\n")
    assert script.restamp(path, write=False) == []


def _stubbed_sweep(monkeypatch, times):
    """scripts/sweep_configs.py with no compiling, checks or GPU: each timing returns the next of `times` and is
    recorded as (causal, block_n) in the list returned beside the module; the heads each measure and the group each
    compile was built for in sweep.built."""
    sweep, calls, times = load_script("sweep_configs"), [], iter(times)
    sweep.built = []

    def make_measure(kernel, head_dim, dtype, causal, *, seqlens, device, tokens, heads):
        sweep.built.append(("measure", heads))

        def measure(cfg):
            calls.append((causal, cfg.block_n))
            return next(times)

        measure.inputs = [None]
        return measure

    monkeypatch.setattr(sweep.workload, "make_measure", make_measure)
    monkeypatch.setattr(sweep.compile_pool, "precompile",
                        lambda *args, group, **kwargs: sweep.built.append(("compile", group)) or {})  # fmt: skip
    monkeypatch.setattr(sweep, "_outputs", lambda kernel, cfg, x, causal: (torch.ones(4), torch.ones(4)))
    return sweep, calls


def test_sweep_rounds_rotate_the_order_and_report_each_config_s_median(monkeypatch, tmp_path):
    # scripts/sweep_configs.py --rounds R (a reading moves with its place in the order): every config that ran right
    # is timed R times, round r starting r configs further on, and its row is the median.
    sweep, order = _stubbed_sweep(monkeypatch, [4.0, 2.0, 1.0, 3.0, 5.0, 6.0, 2.5, 1.5, 3.5, 2.0, 2.2, 2.4] * 2)
    csv_path = tmp_path / "sweep.csv"
    assert sweep.main(["--kernel", "fwd", "--head-dims", "64", "--seqlen", "256", "--block-m", "64",
                       "--block-n", "16,32,64", "--warps", "4", "--stages", "2", "--rounds", "2",
                       "--device", "cpu", "--csv", str(csv_path)]) == 0  # fmt: skip
    n_order = [n for causal, n in order]
    assert n_order == [16, 32, 64, 16, 32, 64, 32, 64, 16, 32, 64, 16]  # round 2 starts one config further on
    rows = list(csv.DictReader(open(csv_path)))
    assert [row["readings"].count(" ") for row in rows] == [1] * 6  # two readings each
    for row in rows:
        first, second = map(float, row["readings"].split())
        assert float(row["tflops"]) == pytest.approx((first + second) / 2)  # the median of two


def test_sweep_causal_option_times_only_the_masks_asked_for(monkeypatch, tmp_path):
    # --causal no: a change to the unmasked code path is swept without timing causal configs
    sweep, calls = _stubbed_sweep(monkeypatch, [1.0] * 100)
    csv_path = tmp_path / "sweep.csv"
    for option, expected in (("no", {False}), ("yes", {True}), ("both", {False, True})):
        calls.clear()
        assert sweep.main(["--kernel", "fwd", "--head-dims", "64", "--seqlen", "256", "--block-m", "64",
                           "--block-n", "16,32", "--warps", "4", "--stages", "2", "--causal", option,
                           "--device", "cpu", "--csv", str(csv_path)]) == 0  # fmt: skip
        assert {causal for causal, _ in calls} == expected and len(calls) == 2 * len(expected)
        assert {row["causal"] for row in csv.DictReader(open(csv_path))} == {str(c) for c in expected}


def test_sweep_at_a_gqa_models_heads_compiles_and_times_its_grouping(monkeypatch, capsys):
    # --heads / --kv-heads: the configs are compiled for the group and timed at those heads, as a tune's are
    sweep, timed = _stubbed_sweep(monkeypatch, [1.0] * 100)
    args = ["--kernel", "fwd", "--head-dims", "64", "--seqlen", "256", "--block-m", "64", "--block-n", "16",
            "--warps", "4", "--stages", "2", "--causal", "yes", "--device", "cpu"]  # fmt: skip
    assert sweep.main([*args, "--heads", "32", "--kv-heads", "8"]) == 0
    assert sweep.built == [("compile", 4), ("measure", (32, 8))] and len(timed) == 1
    sweep.built.clear()
    assert sweep.main(args) == 0
    assert sweep.built == [("compile", 1), ("measure", (32, 32))]  # the grid's: 2048 // d heads, MHA
    with pytest.raises(SystemExit):
        sweep.main([*args, "--heads", "32", "--kv-heads", "5"])
    assert "--kv-heads must divide the query heads, got 32 and 5 at d=64" in capsys.readouterr().err


def test_hf_training_benchmark_times_a_step_under_each_implementation(capsys):
    # scripts/bench_hf_training.py on a tiny Llama with padded rows: a row for "sdpa" and one for "fa2tune", each
    # with a step time, tokens/s over the unpadded tokens, and the loss, which the two implementations share.
    pytest.importorskip("transformers")
    script = load_script("bench_hf_training")
    sizes = ["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "97", "--seqlen", "20"]
    assert script.main([*sizes, "--batch", "2", "--pad", "0.25", "--warmup", "0", "--steps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "30 unpadded tokens" in lines[1]
    rows = {line.split()[0]: line.split() for line in lines[3:5]}
    assert set(rows) == {"sdpa", "fa2tune"} and all(float(row[3].replace(",", "")) > 0 for row in rows.values())
    assert float(rows["sdpa"][4]) == pytest.approx(float(rows["fa2tune"][4]), abs=2e-3)
    assert lines[5].startswith("fa2tune speed / sdpa speed:")


def test_hf_generate_benchmark_times_a_decode_step_under_each_implementation(capsys, monkeypatch):
    # scripts/bench_hf_generate.py on a tiny Llama from left-padded prompts: a row for "sdpa" and one for "fa2tune",
    # each with a decode step's time and the share of its tokens that are the first implementation's (greedy, fp32:
    # all of them); fa2tune's decode steps read the cache in place
    pytest.importorskip("transformers")
    from fa2tune.integrations import transformers as fa2tune_hf

    script = load_script("bench_hf_generate")
    in_place = []
    real = fa2tune_hf.flash_attn_with_kvcache
    monkeypatch.setattr(fa2tune_hf, "flash_attn_with_kvcache", lambda *a, **kw: in_place.append(1) or real(
        *a, **kw))  # fmt: skip
    sizes = ["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "97", "--dtype", "fp32"]
    assert script.main([*sizes, "--batch", "3", "--prompt", "12", "--new-tokens", "2", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "batch 3 x 12 prompt tokens, 27 unpadded" in lines[1]
    rows = {line.split()[0]: line.split() for line in lines[3:5]}
    assert set(rows) == {"sdpa", "fa2tune"} and all(float(row[1]) >= 0 for row in rows.values())
    assert rows["fa2tune"][3] == "100.0%"
    assert lines[5].startswith("fa2tune speed / sdpa speed:")
    assert len(in_place) == 2 * 2  # generate(3) warm-up and timed: 2 decode steps each, 1 layer (generate(1): none)


def test_persistent_rounds_counts_the_last_round_s_fill():
    # scripts/persistent_rounds.py: units equal to the programs fill one round; one unit more takes a second round
    # that holds it alone; causal pairs make a head's tiles half as many units of twice the work
    script = load_script("persistent_rounds")
    assert script.busy(1024, 1024, 16, 128, 128, causal=False) == 1.0  # 16 heads × 8 tiles = 128 units
    assert script.busy(1024, 1024, 16, 128, 127, causal=False) == pytest.approx(128 / (127 * 2))
    assert script.busy(1024, 1024, 16, 128, 64, causal=True) == 1.0  # 16 heads × 4 pairs = 64 units
    assert script.busy(1152, 1152, 1, 128, 5, causal=True) == pytest.approx(4.5 / (5 * 1.0))  # 9 tiles: 4 pairs, 1 half


def test_backward_timer_checks_gradients_against_float64_and_parses_its_shapes(monkeypatch):
    # scripts/time_backward.py's check, through the interpreter at a small ragged length: the kernels' gradients
    # read within bf16's tolerance, and gradients off by 10 % of their scale do not
    from fa2tune.api import ops
    from fa2tune.config.types import KernelConfig

    time_backward = load_script("time_backward")
    monkeypatch.setattr(time_backward, "CHECK_LENGTH", 37)
    config = KernelConfig.parse("32,32,4,1")
    assert time_backward._check(ops, 32, True, config, device="cpu") < 2e-2
    real = ops.backward
    monkeypatch.setattr(ops, "backward", lambda *a, **kw: tuple(g + 0.1 * g.abs().max() for g in real(*a, **kw)))
    assert time_backward._check(ops, 32, True, config, device="cpu") > 5e-2
    assert time_backward._parse_shape("96,8192,causal,64,128,4,2,ws,fused-dq") == (
        96, 8192, True, "64,128,4,2,ws,fused-dq"
    )
    with pytest.raises(argparse.ArgumentTypeError, match=r"head_dim,seqlen,plain\|causal,config.*got .96,8192,masked"):
        time_backward._parse_shape("96,8192,masked,64,128,4,2")


def test_backward_timer_checks_grouped_query_gradients_too(monkeypatch):
    # --check at a grouped-query shape checks the kernels there: dK and dV summed over each K/V head's query heads
    from fa2tune.api import ops
    from fa2tune.config.types import KernelConfig

    time_backward = load_script("time_backward")
    monkeypatch.setattr(time_backward, "CHECK_LENGTH", 37)
    shapes = []
    real = ops.backward
    monkeypatch.setattr(ops, "backward", lambda do, q, k, *a, **kw: (shapes.append((q.shape[1], k.shape[1])),
                                                                     real(do, q, k, *a, **kw))[1])  # fmt: skip
    assert time_backward._check(ops, 32, True, KernelConfig.parse("32,32,4,1"), device="cpu", group=4) < 2e-2
    assert shapes == [(4, 1)]


def test_backward_timer_reports_a_config_that_does_not_fit_and_times_the_rest(monkeypatch, capsys):
    # A shape whose config is past the card's shared memory is reported and the run goes on to the next shape,
    # with a failing exit status.
    from triton.runtime.errors import OutOfResources

    time_backward = load_script("time_backward")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def fake_time(ops, head_dim, *args):
        if head_dim == 128:
            raise OutOfResources(263752, 232448, "shared memory")
        return 2.0

    monkeypatch.setattr(time_backward, "_time_ms", fake_time)
    status = time_backward.main(["--shape", "128,8192,causal,64,128,4,2,ws,fused-dq,persistent",
                                 "--shape", "64,8192,causal,64,128,4,3,ws,fused-dq,persistent"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 1
    assert "does not fit: out of resource: shared memory" in out
    assert any(line.split()[:2] == ["64", "8192"] and "2.0000" in line for line in out.splitlines())


def test_backward_timer_refuses_kv_heads_that_do_not_divide_the_heads(capsys):
    time_backward = load_script("time_backward")
    with pytest.raises(SystemExit) as exit_info:
        time_backward.main(["--shape", "64,1024,plain,64,128,4,2", "--heads", "16", "--kv-heads", "5"])
    assert exit_info.value.code == 2 and "--kv-heads must divide --heads (16); got 5" in capsys.readouterr().err


def test_a_causal_grid_launched_head_by_head_leaves_sms_idle_that_interleaved_heads_fill():
    # scripts/persistent_rounds.py --per-tile: with few K/V heads (GQA), launching each head's tiles longest first,
    # head after head, starts the last heads' longest tiles late; interleaving the heads' tiles balances the SMs
    script = load_script("persistent_rounds")
    shape = dict(tokens=16384, heads=4, rows=128, programs=132, group=8, q_rows=64, overhead=1.2)
    head_by_head = script.per_tile_busy(8192, interleave=1, **shape)
    interleaved = script.per_tile_busy(8192, interleave=4, **shape)
    assert head_by_head < 0.9 < 0.98 < interleaved <= 1.0
    # one head: nothing to interleave, the same order either way
    one = dict(shape, tokens=8192, heads=1)
    assert script.per_tile_busy(8192, interleave=1, **one) == script.per_tile_busy(8192, interleave=4, **one)



def test_persistent_rounds_refuses_an_interleave_below_one(capsys):
    script = load_script("persistent_rounds")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--per-tile", "--interleave", "0"])
    assert exit_info.value.code == 2 and "--interleave must be at least 1" in capsys.readouterr().err


def test_profile_backward_refuses_a_group_that_does_not_divide_the_heads(capsys):
    # scripts/profile_backward.py takes 2048 // d query heads at each head dim; --group (GQA) must divide every one,
    # checked before it looks for a GPU: d=96's 21 heads take a group of 3, d=128's 16 do not
    script = load_script("profile_backward")
    for argv, named in ((["--head-dims", "96,128", "--group", "3"], "d = 128"), (["--group", "0"], "d = 64, 128")):
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "--group must be >= 1 and divide" in err and named in err, err


def test_hf_generate_benchmark_says_when_a_step_read_no_time(capsys):
    # a decode step is generate() minus its prefill, which a busy host with one repeat can read as 0 (clamped): the
    # ratio line then says it was not measured instead of dividing by zero or going missing
    import argparse

    import torch

    script = load_script("bench_hf_generate")
    tokens = torch.zeros(2, 3, dtype=torch.long)
    script.report(argparse.Namespace(batch=2), {"sdpa": (0.01, tokens), "fa2tune": (0.0, tokens)})
    assert "fa2tune speed / sdpa speed: not measured" in capsys.readouterr().out
