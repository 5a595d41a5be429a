"""A GGUF with a real model's shapes and weight formats but random weights, for benchmarks
where the real file cannot be had (an offline machine, or one that cannot take its size).

    python tools/synthetic_model.py --like smollm2-135m-instruct --out build/smollm2.synthetic.gguf
    python tools/synthetic_model.py --record REAL.gguf --card tools/model_cards/NAME.json

`--record` reads a real GGUF's header and writes its card: the architecture's metadata (the
scalars and short arrays, without the tokenizer's tables or descriptive `general.*` keys), the
vocabulary size and every tensor's name, shape and format. `--like NAME` writes a model from
tools/model_cards/NAME.json: that metadata, a synthetic byte-level BPE vocabulary of the same
size (llama.cpp loads no GGUF without one; the text it tokenizes to is noise), and each tensor
in its recorded format filled as tools/bench_ops.py fills timing weights (random quants, every
f16 block field a small finite value; norm weights are 1). vkrt and llama.cpp then run the
real model's kernels over the same bytes, so a ratio between them measured on the twin stands
for the real file's (docs/BENCHMARKS.md: how close vkrt's own speed came); the text it writes
is noise and no accuracy can be read from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from string import ascii_lowercase

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import random_storage  # noqa: E402

from vkrt.core.formats import by_gguf_type  # noqa: E402

CARDS = Path(__file__).resolve().parent / "model_cards"
EOS = "<|endoftext|>"
# Metadata a card leaves out: the tokenizer's tables (a twin gets a synthetic vocabulary) and
# what describes the original file rather than its shapes.
DROPPED_PREFIXES = ("tokenizer.", "general.")
KEPT_GENERAL = ("general.architecture", "general.file_type", "general.quantization_version")


def record(path: Path, card: Path) -> None:
    """Write the card of the real GGUF at `path`."""
    reader = gguf.GGUFReader(str(path))
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or (key.startswith(DROPPED_PREFIXES) and key not in KEPT_GENERAL):
            continue
        value = field.contents()
        kind = field.types[0].name
        if kind == "ARRAY":
            kind += ":" + field.types[-1].name
        metadata[key] = {"type": kind, "value": value}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = len(tokens.data) if tokens else int(embedding.shape[-1])
    head = json.dumps({"source": path.name, "vocab_size": vocab_size, "metadata": metadata}, indent=1)
    rows = ",\n".join("  " + json.dumps([t.name, [int(n) for n in t.shape], t.tensor_type.name])
                      for t in reader.tensors)
    card.parent.mkdir(parents=True, exist_ok=True)
    card.write_text(head[:-2] + ',\n "tensors": [\n' + rows + "\n ]\n}\n")  # a tensor per line


def vocabulary(size: int) -> tuple[list[str], list[str]]:
    """`size` tokens and their merges: GPT-2's 256 byte symbols, merges of lowercase letter
    pairs, the same after a space, then ever longer letter runs, then the end-of-text token."""
    if size < 258:
        raise SystemExit(f"synthetic_model: a vocabulary of {size} tokens is under the 256 bytes, a merge and the end token")
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    space = symbols[ord(" ")]
    wanted = size - 256 - 1
    merges: list[tuple[str, str]] = [(space, a) for a in ascii_lowercase]
    words = list(ascii_lowercase)
    while len(merges) < wanted:  # each round: every word so far, extended by every letter
        longer = [(w, a) for w in words for a in ascii_lowercase]
        merges += longer + [(space + w, a) for w, a in longer if len(w) == 1]
        words = [w + a for w, a in longer]
    merges = merges[:wanted]
    tokens = symbols + [left + right for left, right in merges] + [EOS]
    return tokens, [f"{left} {right}" for left, right in merges]


def add_vocabulary(writer: gguf.GGUFWriter, size: int) -> None:
    """Embed vocabulary(size) as a GPT-2 BPE tokenizer whose last token ends text (and begins
    it: no BOS is added)."""
    tokens, merges = vocabulary(size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)


def _add_metadata(writer: gguf.GGUFWriter, key: str, entry: dict) -> None:
    kind, value = entry["type"], entry["value"]
    if kind.startswith("ARRAY"):
        writer.add_array(key, value)
    else:
        writer.add_key_value(key, value, gguf.GGUFValueType[kind])


def tensor_data(name: str, shape: list[int], fmt: str,
                rng: np.random.Generator) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """Random data for one tensor in GGUF shape order (innermost first), and its raw dtype."""
    rows = [int(n) for n in reversed(shape)]  # numpy order
    qtype = gguf.GGMLQuantizationType[fmt]
    spec = by_gguf_type(int(qtype))
    if spec is None:
        raise SystemExit(f"synthetic_model: {name}: format {fmt} is not one vkrt reads")
    if not spec.is_block and name.endswith("norm.weight"):
        return np.ones(rows, np.float32).astype(np.float16 if fmt == "F16" else np.float32), None
    if spec.is_block and rows[-1] % spec.block_values:
        raise SystemExit(f"synthetic_model: {name}: a row of {rows[-1]} values is not whole {fmt} blocks")
    data = random_storage(rng, spec.name, int(np.prod(rows[:-1])), rows[-1])
    if spec.is_block or fmt == "BF16":  # raw bytes, which the writer reads through the format
        return data.view(np.uint8).reshape(*rows[:-1], -1), qtype
    return data.reshape(rows), None


def write(card_path: Path, out: Path, seed: int) -> None:
    """Write the synthetic twin of the card at `card_path` to `out`."""
    card = json.loads(card_path.read_text())
    meta = card["metadata"]
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), meta["general.architecture"]["value"])
    for key, entry in meta.items():
        if key != "general.architecture":
            _add_metadata(writer, key, entry)
    writer.add_name(f"synthetic twin of {card['source']}")
    add_vocabulary(writer, card["vocab_size"])
    rng = np.random.default_rng(seed)
    for name, shape, fmt in card["tensors"]:
        data, raw = tensor_data(name, shape, fmt, rng)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)  # whole or not at all: a run stopped midway leaves no twin behind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--like", metavar="NAME", help=f"write the twin of a card in {CARDS.name}/: "
                      + ", ".join(sorted(p.stem for p in CARDS.glob("*.json"))))
    what.add_argument("--record", type=Path, metavar="GGUF", help="write the card of this real GGUF")
    parser.add_argument("--out", type=Path, help="the twin's path (with --like)")
    parser.add_argument("--card", type=Path, help="the card's path (with --record)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.record:
        if not args.card:
            parser.error("--record needs --card")
        record(args.record, args.card)
        print(args.card)
        return 0
    card = CARDS / f"{args.like}.json"
    if not card.is_file():
        parser.error(f"no card {card}")
    if not args.out:
        parser.error("--like needs --out")
    write(card, args.out, args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
