"""Tokenizer speed: HF ``tokenizers`` against our TextTokenizer (tiktoken fast path) in the same run.

    python -m bench.tokenize_bench [--model-dir DIR] [--tokens 9800] [--repeats 50]

The prompt is ~9.8k tokens of non-repetitive text: pseudo-words drawn with a fixed seed from eight
scripts, with numbers, punctuation, code-like fragments and line breaks, so neither library's caches see
the same word often. Prints the median milliseconds per encode of each and their ratio, checks the IDs
are identical, and reports load times.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

# Syllables per script: words are random 1-4 syllable strings, so the vocabulary is huge and varied.
SYLLABLES = {
    "latin": ["ka", "lo", "mi", "ren", "dus", "tor", "bel", "qui", "stra", "phe", "ung", "ix", "ow", "ae"],
    "accented": ["é", "ür", "ñá", "ço", "øy", "ål", "ïn", "ẞe", "œu", "ğı", "şa", "ł", "ž", "ť"],
    "cyrillic": ["при", "ве", "ток", "ша", "мир", "зна", "ль", "ый", "де", "ро", "жи", "щу"],
    "greek": ["κα", "λη", "με", "ρα", "θε", "ος", "ψυ", "χή", "ων", "ίτ", "γρ", "ζω"],
    "cjk": ["的", "一", "是", "不", "了", "人", "我", "在", "有", "他", "这", "中", "大", "来", "上", "国", "个",
            "到", "说", "们", "为", "子", "和", "你", "地", "出", "道", "也", "时", "年"],
    "japanese": ["か", "な", "の", "テ", "キ", "ス", "ト", "ま", "す", "で", "し", "た", "ロ", "グ"],
    "arabic": ["مر", "حب", "ال", "عر", "بي", "ة", "سل", "ام", "كت", "ا"],
    "hangul": ["한", "국", "어", "텍", "스", "트", "입", "니", "다", "사", "람"],
}
PUNCTUATION = [", ", ". ", "! ", "? ", "; ", ": ", " — ", " (", ") ", "\n", "\n\n", " \"", "\" "]
CODE = ["x = {}", "f(a, b)", "arr[i+1]", "if (n > 0) {{", "return None", "<div>", "//", "# note", "0x{:x}"]


def nonrepetitive_text(target_tokens: int, count_tokens, seed: int = 2026) -> str:
    """Deterministic text of about ``target_tokens`` tokens with no repeated passage."""
    rng = random.Random(seed)
    scripts = list(SYLLABLES)
    parts: list[str] = []
    while True:
        for _ in range(40):
            roll = rng.random()
            if roll < 0.80:
                syllables = SYLLABLES[rng.choice(scripts)]
                word = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
                parts.append((" " if rng.random() < 0.85 else "") + (word.capitalize() if rng.random() < 0.1 else word))
            elif roll < 0.88:
                parts.append(" " + str(rng.randint(0, 10 ** rng.randint(1, 7))))
            elif roll < 0.97:
                parts.append(rng.choice(PUNCTUATION))
            else:
                parts.append(" " + rng.choice(CODE).format(rng.randint(0, 65535)))
        text = "".join(parts)
        if count_tokens(text) >= target_tokens:
            return text


def interleaved_medians(fns: dict, text: str, repeats: int) -> dict[str, tuple[float, float]]:
    """(wall ms, CPU ms) medians per call of each function.

    Calls are interleaved so that all functions see the same machine load; CPU time (the process's,
    all threads) is the steadier figure on a shared machine, where wall time includes waiting for a core.
    """
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(text)  # warm up (caches, lazy init)
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn(text)
            samples[name].append(((time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000))
    return {name: (statistics.median(s[0] for s in values), statistics.median(s[1] for s in values))
            for name, values in samples.items()}


def bare_tiktoken(tokenizer_file):
    """tiktoken's encode_ordinary over the file's ranks and split regex, nothing else (None if not byte-level)."""
    import tiktoken

    from render_service.tokenize.byte_level import byte_level_ranks
    from render_service.tokenize.tokenizer_json import read_tokenizer_spec

    spec = read_tokenizer_spec(tokenizer_file.read_bytes())
    ranks = byte_level_ranks(spec["model"]["vocab"])
    steps = (spec.get("pre_tokenizer") or {}).get("pretokenizers") or []
    if ranks is None or not steps or "Regex" not in (steps[0].get("pattern") or {}):
        return None
    encoding = tiktoken.Encoding("bare", pat_str=steps[0]["pattern"]["Regex"], mergeable_ranks=ranks,
                                 special_tokens={})
    return encoding.encode_ordinary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="model bundle directory (default: the built-in default bundle)")
    parser.add_argument("--tokens", type=int, default=9800, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)

    from pathlib import Path

    from tokenizers import Tokenizer

    from render_service.tokenize.tokenizer import TextTokenizer

    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from render_service.bundle.default_bundle import default_bundle_dir

        model_dir = default_bundle_dir()
    tokenizer_file = model_dir / "tokenizer.json"

    start = time.perf_counter()
    hf = Tokenizer.from_file(str(tokenizer_file))
    hf_load = time.perf_counter() - start
    start = time.perf_counter()
    ours = TextTokenizer.from_file(tokenizer_file)
    ours_load = time.perf_counter() - start

    def hf_encode(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False).ids

    text = nonrepetitive_text(args.tokens, lambda t: len(hf_encode(t)))
    reference = hf_encode(text)
    identical = ours.encode(text) == reference
    fns = {"tokenizers": hf_encode, "TextTokenizer": ours.encode}
    floor = bare_tiktoken(tokenizer_file)
    if floor is not None:
        fns["bare tiktoken"] = floor  # no added-token split, no NFC check: the floor our wrapper adds to
    timings = interleaved_medians(fns, text, args.repeats)
    (hf_wall, hf_cpu), (ours_wall, ours_cpu) = timings["tokenizers"], timings["TextTokenizer"]

    print(f"bundle:          {model_dir}")
    print(f"prompt:          {len(reference)} tokens, {len(text)} characters, "
          f"{len(set(text.split()))} distinct words of {len(text.split())}")
    print(f"TextTokenizer:   {ours.fast_path_reason}")
    print(f"identical IDs:   {identical}")
    print(f"load:            tokenizers {hf_load * 1000:.0f} ms, TextTokenizer {ours_load * 1000:.0f} ms "
          "(tokenizers' load + fast path build + self-check)")
    print(f"encode, median of {args.repeats} interleaved runs:")
    print(f"  tokenizers     {hf_wall:8.2f} ms wall {hf_cpu:8.2f} ms CPU")
    print(f"  TextTokenizer  {ours_wall:8.2f} ms wall {ours_cpu:8.2f} ms CPU")
    if "bare tiktoken" in timings:
        bare_wall, bare_cpu = timings["bare tiktoken"]
        print(f"  bare tiktoken  {bare_wall:8.2f} ms wall {bare_cpu:8.2f} ms CPU")
    print(f"  speed-up       {hf_wall / ours_wall:8.1f}x wall {hf_cpu / max(ours_cpu, 1e-9):8.1f}x CPU")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
