"""Request sets for ``splitserve-bench serve``: vLLM's ``random`` and ``sharegpt`` datasets, plus conversations.

random: each prompt is ``input_len`` random token ids (lengths drawn uniformly from
[len*(1-r), len*(1+r)] with ``--random-range-ratio r``), decoded to text; the output length is drawn the same
way. sharegpt: a JSON list of ``{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}``; the first
human turn is the prompt and the first gpt turn sets the output length (or ``--sharegpt-output-len``).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from tokenizers import Tokenizer

SAMPLE_SHAREGPT = Path(__file__).resolve().parent / "data" / "sharegpt_sample.json"


@dataclasses.dataclass
class SampleRequest:
    """One request (or, in multi-turn mode, one conversation: ``turns`` user messages)."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    turns: list[str] = dataclasses.field(default_factory=list)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A ``tokenizer.json`` file or a model directory holding one."""
    path = Path(path)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


def _length(rng: random.Random, center: int, ratio: float) -> int:
    low, high = int(center * (1 - ratio)), int(center * (1 + ratio))
    return max(1, rng.randint(max(low, 1), max(high, 1)))


def _random_text(tokenizer: Tokenizer, rng: random.Random, length: int, special: set[int]) -> tuple[str, int]:
    """Text of about ``length`` tokens from random ids; re-tokenizing decoded text can merge ids, so the
    count is corrected once by topping up or trimming and the final count is what is reported."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=False)
    ids = [rng.randrange(vocab) for _ in range(length)]
    ids = [i if i not in special else (i + 1) % vocab for i in ids]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    encoded = tokenizer.encode(text, add_special_tokens=False).ids
    if len(encoded) > length:
        text = tokenizer.decode(encoded[:length], skip_special_tokens=True)
    return text, len(tokenizer.encode(text, add_special_tokens=False).ids)


def random_requests(tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0, turns: int = 1) -> list[SampleRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = random.Random(seed)
    special = set(tokenizer.get_added_tokens_decoder()) if hasattr(tokenizer, "get_added_tokens_decoder") else set()
    out = []
    for _ in range(num_prompts):
        texts, lens = [], []
        for _ in range(max(turns, 1)):
            text, n = _random_text(tokenizer, rng, _length(rng, input_len, range_ratio), special)
            texts.append(text)
            lens.append(n)
        out.append(SampleRequest(texts[0], lens[0], _length(rng, output_len, range_ratio), texts))
    return out


def sharegpt_requests(path: str | Path, tokenizer: Tokenizer, num_prompts: int, seed: int = 0,
                      output_len: int | None = None, turns: int = 1) -> list[SampleRequest]:
    """Conversations with at least one human and one gpt turn, shuffled with ``seed``; like vLLM, pairs
    whose prompt or completion is under 4 tokens, or whose prompt is over 1024 tokens, are skipped."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    rng = random.Random(seed)
    rng.shuffle(data)
    out: list[SampleRequest] = []
    for entry in data:
        convo = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(convo, list) or len(convo) < 2:
            continue
        humans = [t.get("value", "") for t in convo if isinstance(t, dict) and t.get("from") == "human"]
        gpts = [t.get("value", "") for t in convo if isinstance(t, dict) and t.get("from") == "gpt"]
        if not humans or not gpts:
            continue
        prompt_len = len(tokenizer.encode(humans[0], add_special_tokens=False).ids)
        completion_len = len(tokenizer.encode(gpts[0], add_special_tokens=False).ids)
        expected = output_len or completion_len
        if prompt_len < 4 or (output_len is None and completion_len < 4) or prompt_len > 1024:
            continue
        if turns > 1 and len(humans) < turns:
            humans = humans + [humans[-1]] * (turns - len(humans))
        out.append(SampleRequest(humans[0], prompt_len, expected, humans[: max(turns, 1)]))
        if len(out) == num_prompts:
            break
    if len(out) < num_prompts:
        raise ValueError(f"{path}: only {len(out)} usable conversations for --num-prompts {num_prompts}")
    return out


def write_sharegpt_sample(path: str | Path, conversations: int = 40, seed: int = 0) -> Path:
    """A small ShareGPT-format file of generated prose (no real chat data), 2-4 turns per conversation."""
    from bench.render_bench import nonrepetitive_text

    rng = random.Random(seed)
    data = []
    for i in range(conversations):
        convo = []
        for _ in range(rng.randint(2, 4)):
            convo.append({"from": "human", "value": nonrepetitive_text(rng, rng.randint(20, 80))})
            convo.append({"from": "gpt", "value": nonrepetitive_text(rng, rng.randint(10, 60))})
        data.append({"id": f"sample-{i}", "conversations": convo})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=0) + "\n")
    return path


if __name__ == "__main__":
    print(write_sharegpt_sample(SAMPLE_SHAREGPT))
