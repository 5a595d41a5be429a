"""Plant small bugs in a copy of the tree and check that the tests catch each one.

Each mutant replaces one exact snippet in one file of a throwaway copy of the committed
tree (`git archive HEAD`; the working tree is never touched), regenerates the SPIR-V in the
copy when the file is a shader, and runs the narrow pytest selection that should catch
it. A mutant is caught when that run fails, survives when it passes; before the mutants,
each distinct selection runs once unmutated and must pass, or its mutants are not judged.

    python tools/mutation_check.py                  # every mutant
    python tools/mutation_check.py --only split     # mutants whose name contains "split"
    python tools/mutation_check.py --list           # names and selections, nothing run

It is CPU-heavy (each shader mutant recompiles every shader and JIT-compiles its kernels
on llvmpipe): a script to run by hand, not a CI test. docs/TESTING.md has its last table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = "tests/backend/test_kernel_configs.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # file in the tree
    old: str  # exact snippet, present once
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail


MUTANTS = [
    # Shader constants and reduction trees.
    Mutant("split-K partial sums stop at 8 lanes", "shaders/matmul_vec.comp",
           "for (uint half_ = SPLIT / 2u;", "for (uint half_ = min(SPLIT, 8u) / 2u;",
           (CONFIGS, "-k", "matmul_configuration and matmul-q4_1 and (s16 or s32)")),
    Mutant("tiled matmul adds its register sets one level short", "shaders/matmul_tiled.comp",
           "for (uint h = SETS / 2u; h > 0u; h /= 2u) {", "for (uint h = min(SETS, 4u) / 2u; h > 0u; h /= 2u) {",
           ("tests/ops/test_matmul_tiled.py", "-k", "matches_reference_and_vec and q4_1")),
    Mutant("tiled matmul's lane tree adds a lane's own sum", "shaders/matmul_tiled.comp",
           "vec4 other = w_tile[(tid ^ h) * NVEC + v];", "vec4 other = w_tile[tid * NVEC + v];",
           ("tests/ops/test_matmul_tiled.py", "-k", "matches_reference_and_vec and q4_1")),
    Mutant("row reduction tree stops at 64 lanes", "shaders/include/reduce.glsl",
           "float workgroup_sum(float v) {\n    if (ROW_LANES == 1u) return v;  // folded away at specialisation\n"
           "    uint l = gl_LocalInvocationID.x;\n    reduce_scratch[l] = v;\n    barrier();\n"
           "    for (uint s = ROW_LANES / 2u;",
           "float workgroup_sum(float v) {\n    if (ROW_LANES == 1u) return v;  // folded away at specialisation\n"
           "    uint l = gl_LocalInvocationID.x;\n    reduce_scratch[l] = v;\n    barrier();\n"
           "    for (uint s = min(ROW_LANES, 64u) / 2u;",
           (CONFIGS, "-k", "row_kernels")),
    Mutant("attention LOG2E off by 0.1%", "shaders/include/attention.glsl",
           "const float LOG2E = 1.4426950408889634;", "const float LOG2E = 1.4441377;",
           (CONFIGS, "-k", "paged_attention_configuration and (seq8 or sub8)")),
    Mutant("paged attention's lane stride crosses at most one block (while -> if)", "shaders/include/attention.glsl",
           "while (off >= pc.block_size) { off -= pc.block_size; ++b; }",
           "if (off >= pc.block_size) { off -= pc.block_size; ++b; }",
           ("tests/ops/test_attention.py", "-k", "paged_attention_decode and block4 and f16 and sub")),
    Mutant("q4_0 offset -8 -> -7 in the shader", "shaders/include/quant.glsl",
           "r = fma(unpackHalf2x16(scale).x, fma(xsum, -8.0, p), acc);",
           "r = fma(unpackHalf2x16(scale).x, fma(xsum, -7.0, p), acc);",
           (CONFIGS, "-k", "matmul_configuration and matmul-q4_0 and s1")),
    Mutant("q6_k offset -32 -> -31 in the shader (second half)", "shaders/include/quant.glsl",
           "r = fma(scale.y, fma(xsum.y, -32.0, p.y), lo);", "r = fma(scale.y, fma(xsum.y, -31.0, p.y), lo);",
           (CONFIGS, "-k", "matmul_configuration and matmul-q6_k and s1")),
    Mutant("chunked delta rule's solve drops its nearest term", "shaders/gated_delta_net_chunk.comp",
           "if (u < r) x -= LD_F32(amat, th * CHUNK + u) * vn[u];",
           "if (u + 1u < r) x -= LD_F32(amat, th * CHUNK + u) * vn[u];",
           ("tests/ops/test_gdn_chunked.py", "-k", "kernel_matches and hk2-hv4 and grouped and 16 and texel")),
    Mutant("chunked delta rule's state carries the decay from the chunk's start", "vkrt/ops/recurrent.py",
           "tail = np.exp(G[:, -1:] - G)  # [H, n]: exp(G_last - G_j)", "tail = np.exp(G[:, -1:])  # [H, n]",
           ("tests/ops/test_gdn_chunked.py", "-k", "reference_equals_recurrent and hk2-hv4")),
    Mutant("chunked Mamba2 scan drops a token's own term from its intra-chunk sum", "shaders/ssm_scan_chunk.comp",
           "if (u <= r) out_value += LD_F32(weights, th * CHUNK + u) * dx[u];",
           "if (u < r) out_value += LD_F32(weights, th * CHUNK + u) * dx[u];",
           ("tests/ops/test_ssm_chunked.py", "-k", "kernel_matches and h4-p8 and no-limit and texel")),
    Mutant("storage-buffer vec4 loads swap two lanes", "shaders/include/access.glsl",
           "#define LD_F32X4(n, i) n[i]", "#define LD_F32X4(n, i) n[i].yxzw",
           ("tests/models/test_golden_paths.py", "-k", "prefill and ssbo and tiny_llama]")),
    # Host-side numerics.
    Mutant("numpy q4_0 dequant offset -8 -> -7", "vkrt/core/formats.py",
           "(_nibbles(b[:, 2:18]).astype(np.float32) - 8.0)", "(_nibbles(b[:, 2:18]).astype(np.float32) - 7.0)",
           ("tests.core.test_formats.py",)),
    Mutant("linear RoPE scaling ignored", "vkrt/models/rope.py",
           'return inv / float(scaling["factor"])', "return inv",
           ("tests/models/test_rope_scaling.py",)),
    Mutant("GGUF rope_freqs multiplied instead of divided", "vkrt/models/rope.py",
           "return inv / np.asarray(freq_factors, dtype=np.float64)",
           "return inv * np.asarray(freq_factors, dtype=np.float64)",
           ("tests/models/test_rope_scaling.py",)),
    # Engine.
    Mutant("prefix-cache hash ignores a block's last token", "vkrt/engine/kv_cache.py",
           "request.all_token_ids[i * bs:(i + 1) * bs]", "request.all_token_ids[i * bs:(i + 1) * bs - 1]",
           ("tests/engine/test_prefix_cache_keys.py",)),
    Mutant("prefix-cache hash not chained to its parent", "vkrt/engine/kv_cache.py",
           'digest = hashlib.sha256(parent or b"")', 'digest = hashlib.sha256(b"")',
           ("tests/engine/test_prefix_cache_keys.py", "tests/engine/test_sliding_prefix.py")),
    Mutant("detokenizer given no prompt context", "vkrt/engine/output.py",
           "IncrementalDetokenizer(tokenizer, request.prompt_token_ids,", "IncrementalDetokenizer(tokenizer, [],",
           ("tests/engine/test_output.py",)),
    Mutant("continue_final_message cuts at the first copy of the reply", "vkrt/engine/prompts.py",
           "cut = text.rfind(final)", "cut = text.find(final)", ("tests/engine/test_prompts.py",)),
    Mutant("host top-p keeps one more at an exact boundary (> for >=)", "vkrt/engine/sampler.py",
           "cumulative[:-1] >= params.top_p", "cumulative[:-1] > params.top_p", ("tests/engine/test_sampler.py",)),
    Mutant("a preempted request is never queued again (generate would loop forever)", "vkrt/engine/scheduler.py",
           "        self.waiting.appendleft(request)\n", "",
           ("tests/engine/test_scheduler.py", "-k", "preemption")),
    Mutant("freed blocks keep their reference", "vkrt/engine/kv_cache.py",
           "            self._ref_counts[block_id] -= 1\n", "            self._ref_counts[block_id] -= 0\n",
           ("tests/engine/test_kv_cache.py", "tests/engine/test_prefix_cache_keys.py")),
    Mutant("stop-string holdback off", "vkrt/engine/output.py",
           "            if any(stop.startswith(suffix) for stop in self.stop_strings):\n                return k",
           "            if any(stop.startswith(suffix) for stop in self.stop_strings):\n                return 0",
           ("tests/engine/test_output.py",)),
    Mutant("min-p keeps only weights above it (> for >=)", "vkrt/ops/sampling.py",
           "keep = weights >= min_p", "keep = weights > min_p",
           ("tests/ops/test_sample.py", "tests/ops/test_sample_min_p_boundary.py", "tests/engine/test_sampler.py")),
    Mutant("host min-p filter at half its threshold", "vkrt/engine/sampler.py",
           "probs[probs < params.min_p * probs.max()] = 0.0", "probs[probs < 0.5 * params.min_p * probs.max()] = 0.0",
           ("tests/engine/test_sampler.py",)),
    Mutant("top-p cut one candidate late", "vkrt/ops/sampling.py",
           "last = _first(cumulative >= top_p * cumulative[-1], default=kept.shape[0] - 1)",
           "last = min(_first(cumulative >= top_p * cumulative[-1], default=kept.shape[0] - 1) + 1, "
           "kept.shape[0] - 1)",
           ("tests/ops/test_sample.py", "tests/engine/test_sampler.py")),
    # Speculative decoding.
    Mutant("a verify step's rows all take the grammar's mask for its first row", "vkrt/engine/guided.py",
           "request.guide.fill_masks(masks[i:i + rows], request.spec_token_ids)",
           "[request.guide.fill_mask(masks[r]) for r in range(i, i + rows)]",
           ("tests/engine/test_speculative.py", "-k", "constrained")),
    Mutant("a hybrid's state is not rolled back after a rejected proposal", "vkrt/engine/engine.py",
           "                request.num_computed_tokens -= 1 + accepted\n                "
           "self.block_manager.roll_back_state(request)\n",
           "                pass\n",
           ("tests/engine/test_speculative_models.py", "-k", "hybrid")),
    Mutant("proposals ride on a chunk that recomputes tokens", "vkrt/engine/scheduler.py",
           "at_end = num_new == 1 and request.num_computed_tokens + 1 == request.num_tokens",
           "at_end = num_new == 1",
           ("tests/engine/test_speculative_models.py", "-k", "hybrid")),
    Mutant("a replayed hybrid verify step skips its checkpoint copies", "vkrt/engine/runner.py",
           "                    self._copy_states(copies.restore)  # flushed by the replay, ahead of it",
           "                    pass",
           ("tests/engine/test_speculative_models.py", "-k", "hybrid")),
    Mutant("the MTP head skips the positions accepted since its last guess", "vkrt/engine/mtp_draft.py",
           "        kept = min(tokens.num_computed_tokens, request.num_computed_tokens - 1)",
           "        kept = request.num_computed_tokens - 1",
           ("tests/engine/test_speculative_mtp.py", "-k", "scratch")),
    Mutant("the MTP head is fed the wrong positions' hidden states", "vkrt/engine/mtp_draft.py",
           "view.hidden[position] = token_hidden[row + position - s.start]",
           "view.hidden[position] = token_hidden[row]",
           ("tests/engine/test_speculative_mtp.py", "-k", "scratch")),
    Mutant("the DeepSeek-form MTP head continues from its normed output", "vkrt/models/mtp.py",
           'out = h if self.form == "deepseek_v3" else ops.rms_norm(h, w.final_norm, c.rms_norm_eps)',
           "out = ops.rms_norm(h, w.final_norm, c.rms_norm_eps)",
           ("tests/models/test_mtp.py",)),
]


def export(dest: Path) -> None:
    """The committed tree (HEAD) into dest, with the venv's editable install bypassed."""
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def environment(copy: Path, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(copy)  # the copy's vkrt, not the editable install's
    env["VKRT_CACHE"] = str(cache)  # fresh pipeline cache; models shared through a link
    return env


def run_tests(copy: Path, env: dict[str, str], args: tuple[str, ...], timeout: int) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    try:
        done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, lines[-1] if lines else done.stderr.strip()[-200:]


def regenerate(copy: Path, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "spirv_gen", "--root", str(copy)], cwd=copy, env=env, check=True,
                   capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="print the mutants and their selections")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per pytest run")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if args.only in m.name]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.path} -> pytest {' '.join(m.tests)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="vkrt-mutants-") as tmp:
        copy, cache = Path(tmp) / "tree", Path(tmp) / "cache"
        export(copy)
        cache.mkdir()
        models = Path(os.environ.get("VKRT_CACHE", Path.home() / ".cache" / "vkrt")) / "models"
        if models.is_dir():
            (cache / "models").symlink_to(models)
        env = environment(copy, cache)
        spirv = copy / "vkrt" / "spirv"
        pristine_spirv = Path(tmp) / "spirv"
        shutil.copytree(spirv, pristine_spirv)
        for m in mutants:  # every snippet must still be there, once
            count = (copy / m.path).read_text().count(m.old)
            if count != 1:
                print(f"stale mutant {m.name!r}: its snippet occurs {count} times in {m.path}", file=sys.stderr)
                return 2
        baseline: dict[tuple[str, ...], bool] = {}
        for tests in dict.fromkeys(m.tests for m in mutants):
            rc, summary = run_tests(copy, env, tests, args.timeout)
            baseline[tests] = rc == 0
            print(f"baseline {'ok' if rc == 0 else 'FAILED'}: pytest {' '.join(tests)}: {summary}", flush=True)
        rows = []
        for m in mutants:
            target = copy / m.path
            original = target.read_text()
            start = time.monotonic()
            try:
                target.write_text(original.replace(m.old, m.new))
                if m.path.startswith("shaders/"):
                    regenerate(copy, env)
                rc, summary = run_tests(copy, env, m.tests, args.timeout)
            finally:
                target.write_text(original)
                if m.path.startswith("shaders/"):
                    shutil.rmtree(spirv)
                    shutil.copytree(pristine_spirv, spirv)
            verdict = ("unjudged" if not baseline[m.tests] else "error" if rc not in (0, 1)
                       else "caught" if rc == 1 else "SURVIVED")
            rows.append((m.name, verdict, f"{time.monotonic() - start:.0f}s", summary))
            print(f"{verdict:9} {m.name} ({rows[-1][2]}): {summary}", flush=True)
    print("\n| planted bug | result | time | tests |\n| --- | --- | --- | --- |")
    for name, verdict, elapsed, summary in rows:
        print(f"| {name} | {verdict} | {elapsed} | {summary} |")
    caught = sum(1 for row in rows if row[1] == "caught")
    print(f"\n{caught} of {len(rows)} caught")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
