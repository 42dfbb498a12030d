"""Our Llama-family models against `transformers` on tiny random-weight checkpoints written by write_random_model.

Same weights, same token ids: logits must match (fp32 tightly, bf16 loosely) for a single prefill, a prefill in
two chunks over cached KV, and a batch of sequences decoding over shuffled, non-contiguous block tables; greedy
generation must equal transformers' greedy `generate` token for token.
"""

import json
import random
from pathlib import Path

import pytest
import torch

from tests.shared_paths import FIXTURES as FIXTURES_DIR
from token_engine.layers.attention import allocate_kv_pool, build_metadata
from token_engine.layers.blocks import RopeSpec, rope_inv_freq, rope_spec_from_config
from token_engine.models import build_model, load_model, read_arch
from token_engine.models.loader import checkpoint_files
from token_engine.models.random_model import randomize_parameters_, write_random_model

transformers = pytest.importorskip("transformers")

# Tiny tensors on a shared 2-core machine: extra intra-op threads only spin (25x slower under load).
torch.set_num_threads(1)

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
if not FIXTURES.exists():
    FIXTURES = FIXTURES_DIR

FP32_TOL = dict(atol=1e-4, rtol=1e-4)

# name -> (arch, overrides): the four families plus the config switches that change the math
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "llama-bias-llama3-rope": (
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        },
    ),
    "qwen2-tied-yarn": (
        "qwen2",
        {
            "tie_word_embeddings": True,
            "vocab_size": 1000,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        },
    ),
    "qwen3-untied-linear-rope": (
        "qwen3",
        {"tie_word_embeddings": False, "vocab_size": 1000, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}),
}
FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    made = {}

    def get(name, dtype="float32"):
        key = (name, dtype)
        if key not in made:
            arch, overrides = VARIANTS[name]
            out = tmp_path_factory.mktemp(f"{name}-{dtype}")
            seed = list(VARIANTS).index(name)  # same weights for every dtype of a variant
            made[key] = write_random_model(out, arch=arch, overrides=overrides, seed=seed, dtype=dtype)
        return made[key]

    return get


@pytest.fixture(scope="module")
def pair(model_dirs):
    """(ours, transformers') for a variant, loaded once per module."""
    loaded = {}

    def get(name, dtype="float32"):
        key = (name, dtype)
        if key not in loaded:
            path = model_dirs(name, dtype)
            torch_dtype = getattr(torch, dtype)
            ours = load_model(path)
            ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
            assert ours.arch.dtype == torch_dtype
            loaded[key] = (ours, ref)
        return loaded[key]

    return get


class PagedDriver:
    """The smallest model runner: a KV pool, per-sequence block tables drawn from a shuffled free list."""

    def __init__(self, model, block_size=4, num_blocks=96, seed=0, device="cpu"):
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.device = device
        self.pool = allocate_kv_pool(num_blocks, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim,
                                     arch.dtype, device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feeds each sequence's new tokens; returns each sequence's logits for its new tokens."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            self.lengths[seq] = end
        meta = build_metadata(query_lens, seq_lens, tables, self.block_size, self.device)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                            meta, self.pool)
        logits = self.model.compute_logits(hidden).cpu()
        out, offset = {}, 0
        for seq, n in zip(chunks, query_lens):
            out[seq] = logits[offset : offset + n]
            offset += n
        return out


def prompt(vocab_size, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


@torch.no_grad()
def reference_logits(ref, tokens):
    return ref(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_single_prefill_logits_match_transformers(pair, name):
    ours, ref = pair(name)
    tokens = prompt(ours.arch.vocab_size, 29, seed=1)
    logits = PagedDriver(ours, seed=2).step({0: tokens})[0]
    assert logits.dtype == torch.float32 and logits.shape == (29, ours.arch.vocab_size)
    torch.testing.assert_close(logits, reference_logits(ref, tokens), **FP32_TOL)


@pytest.mark.parametrize("name", FAMILIES + ["mistral-sliding-window"])
def test_prefill_in_two_chunks_attends_to_cached_kv(pair, name):
    ours, ref = pair(name)
    tokens = prompt(ours.arch.vocab_size, 27, seed=3)
    driver = PagedDriver(ours, block_size=4, seed=4)
    first = driver.step({0: tokens[:10]})[0]
    second = driver.step({0: tokens[10:]})[0]
    expected = reference_logits(ref, tokens)
    torch.testing.assert_close(first, expected[:10], **FP32_TOL)
    torch.testing.assert_close(second, expected[10:], **FP32_TOL)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_batched_decode_over_shuffled_block_tables_matches(pair, name):
    ours, ref = pair(name)
    vocab = ours.arch.vocab_size
    final = {s: prompt(vocab, n, 10 + s) for s, n in enumerate((11, 23, 7, 15))}
    prompt_lens = {0: 5, 1: 17, 2: 1, 3: 9}
    # one transformers forward per final sequence gives the expected logits of every step (causal)
    expected = {s: reference_logits(ref, tokens) for s, tokens in final.items()}
    driver = PagedDriver(ours, block_size=4, seed=5)
    got = {s: [] for s in final}
    # sequences 0-2 prefill together; 3 joins at step 2 (continuous batching); then everyone decodes
    for step in range(7):
        chunks = {}
        for s, tokens in final.items():
            done = driver.lengths.get(s, 0)
            if s == 3 and step < 2:
                continue
            take = prompt_lens[s] if done == 0 else 1
            if done + take <= len(tokens):
                chunks[s] = tokens[done : done + take]
        out = driver.step(chunks)
        for s, logits in out.items():
            got[s].append(logits)
    for s in final:
        n = driver.lengths[s]
        assert n > prompt_lens[s] + 2
        torch.testing.assert_close(torch.cat(got[s]), expected[s][:n], **FP32_TOL)
    assert all(len(t) * 4 >= driver.lengths[s] for s, t in driver.tables.items())


@torch.no_grad()
def greedy_with_our_model(model, tokens, max_new_tokens):
    driver = PagedDriver(model, block_size=4, seed=9)
    logits = driver.step({0: tokens})[0]
    out = []
    for _ in range(max_new_tokens):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        if nxt in model.arch.eos_token_ids:
            break
        logits = driver.step({0: [nxt]})[0]
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generation_equals_transformers_generate(pair, name):
    ours, ref = pair(name)
    tokens = prompt(ours.arch.vocab_size, 11, seed=21)
    ours_out = greedy_with_our_model(ours, tokens, 20)
    with torch.no_grad():
        ref_out = ref.generate(
            torch.tensor([tokens]),
            attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=ours.arch.eos_token_ids[0],
        )[0, len(tokens) :].tolist()
    assert ours_out == ref_out
    assert len(ours_out) == 20 or ours_out[-1] in ours.arch.eos_token_ids


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_bf16_logits_match_transformers_loosely(pair, name):
    ours, ref = pair(name, "bfloat16")
    ours32, _ = pair(name)
    tokens = prompt(ours.arch.vocab_size, 23, seed=31)
    driver = PagedDriver(ours, seed=32)
    logits = torch.cat([driver.step({0: tokens[:15]})[0], driver.step({0: tokens[15:19]})[0]]
                       + [driver.step({0: [t]})[0] for t in tokens[19:]])
    expected = reference_logits(ref, tokens)
    spread = expected.std().item()
    assert (logits - expected).abs().max().item() < 0.1 * spread + 0.1
    # bf16 model is the fp32 one rounded: it still predicts the same next tokens almost everywhere
    exact = PagedDriver(ours32, seed=33).step({0: tokens})[0]
    agree = (logits.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.9


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    single = write_random_model(tmp_path / "single", arch="llama", seed=5, dtype="float32")
    sharded = write_random_model(tmp_path / "sharded", arch="llama", seed=5, dtype="float32", max_shard_bytes=60_000)
    assert len(checkpoint_files(sharded)) > 2
    assert (sharded / "model.safetensors.index.json").exists()
    a, b = load_model(single), load_model(sharded)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_dtype_override_casts_checkpoint_weights(model_dirs):
    path = model_dirs("qwen2")
    fp32 = load_model(path)
    for dtype in (torch.float16, torch.bfloat16):
        m = load_model(path, dtype=dtype)
        assert m.arch.dtype == dtype
        assert all(p.dtype == dtype for p in m.parameters())
        w = m.model.layers[0].self_attn.qkv_proj.weight
        torch.testing.assert_close(w.float(), fp32.model.layers[0].self_attn.qkv_proj.weight, atol=1e-2, rtol=1e-2)
    m16 = load_model(path, dtype="float16")
    tokens = prompt(m16.arch.vocab_size, 12, seed=41)
    half = PagedDriver(m16).step({0: tokens})[0]
    exact = PagedDriver(fp32).step({0: tokens})[0]
    assert (half.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_fused_projections_hold_the_checkpoint_rows(model_dirs):
    from safetensors.torch import load_file

    path = model_dirs("qwen2")
    model = load_model(path)
    ckpt = load_file(str(path / "model.safetensors"))
    attn = model.model.layers[1].self_attn
    q_rows = model.arch.num_heads * model.arch.head_dim
    kv_rows = model.arch.num_kv_heads * model.arch.head_dim
    assert torch.equal(attn.qkv_proj.weight[:q_rows], ckpt["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(attn.qkv_proj.weight[q_rows + kv_rows :], ckpt["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(attn.qkv_proj.bias[q_rows : q_rows + kv_rows], ckpt["model.layers.1.self_attn.k_proj.bias"])
    mlp = model.model.layers[1].mlp
    assert torch.equal(mlp.gate_up_proj.weight[model.arch.intermediate_size :], ckpt["model.layers.1.mlp.up_proj.weight"])


def test_missing_tensor_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_random_model(tmp_path / "m", arch="llama", dtype="float32")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        load_model(path)


def test_wrong_shape_is_a_clear_error(tmp_path):
    path = write_random_model(tmp_path / "m", arch="llama", dtype="float32")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="shape"):
        load_model(path)


def test_unsupported_architecture_is_rejected(tmp_path):
    path = write_random_model(tmp_path / "m", arch="llama", dtype="float32")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model"):
        load_model(path)


def test_architecture_is_found_by_architectures_when_model_type_is_unknown(tmp_path):
    path = write_random_model(tmp_path / "m", arch="qwen3", overrides={"vocab_size": 300}, dtype="float32")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "custom-qwen3-finetune"
    (path / "config.json").write_text(json.dumps(config))
    arch = read_arch(path)
    assert arch.model_type == "qwen3" and arch.qk_norm


def test_real_qwen3_config_reads_into_the_right_arch():
    arch = read_arch(FIXTURES / "qwen3-0.6b")
    assert (arch.model_type, arch.num_layers, arch.hidden_size, arch.num_kv_heads, arch.head_dim) == (
        "qwen3", 28, 1024, 8, 128)
    assert arch.qk_norm and arch.tie_word_embeddings and not arch.qkv_bias
    assert arch.dtype == torch.bfloat16
    assert 151645 in arch.eos_token_ids
    assert arch.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2


def test_random_model_directory_carries_tokenizer_files(tmp_path):
    path = write_random_model(tmp_path / "m", arch="qwen3", tokenizer_dir=FIXTURES / "qwen3-0.6b", dtype="float32")
    assert (path / "tokenizer.json").exists() and (path / "tokenizer_config.json").exists()
    # our own config, not the tokenizer directory's
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 64
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.token_to_id("<|im_end|>") in read_arch(path).eos_token_ids


def test_qwen2_5_7b_preset_has_the_real_shape():
    from token_engine.models.random_model import checkpoint_shapes, random_model_config

    config, generation = random_model_config(preset="qwen2.5-7b")
    arch = read_arch_from(config)
    assert (arch.model_type, arch.num_layers, arch.hidden_size, arch.intermediate_size) == ("qwen2", 28, 3584, 18944)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (28, 4, 128, 152064)
    params = sum(torch.Size(s).numel() for s in checkpoint_shapes(config).values())
    assert 7.6e9 < params < 7.7e9  # Qwen2.5-7B has 7.62 B parameters


def read_arch_from(config):
    from token_engine.models import arch_from_config

    return arch_from_config(config)


def test_randomize_parameters_is_seeded_and_gives_a_working_model():
    arch = read_arch_from(_tiny_config())
    a, b = build_model(arch), build_model(arch)
    randomize_parameters_(a, seed=3)
    randomize_parameters_(b, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    logits = PagedDriver(a).step({0: [1, 2, 3]})[0]
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def _tiny_config():
    from token_engine.models.random_model import random_model_config

    return random_model_config(arch="llama", dtype="float32")[0]


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
    ],
)
def test_rope_frequencies_match_transformers(rope_parameters):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128, max_position_embeddings=131072,
                         rope_parameters=dict(rope_parameters))
    if rope_parameters["rope_type"] == "default":
        ref_freq = 1.0 / (rope_parameters["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
        ref_scale = 1.0
    else:
        ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, "cpu")
    spec = rope_spec_from_config({"rope_parameters": dict(rope_parameters), "max_position_embeddings": 131072})
    freq, scale = rope_inv_freq(spec, 128, 131072)
    torch.testing.assert_close(freq, ref_freq.float(), atol=0, rtol=1e-6)
    assert scale == pytest.approx(ref_scale)


def test_old_style_rope_config_reads_like_the_new_one():
    old = rope_spec_from_config({"rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 4.0},
                                 "max_position_embeddings": 32768})
    new = rope_spec_from_config({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0},
                                 "max_position_embeddings": 32768})
    assert old == new
    assert old.param("original_max_position_embeddings") == 32768


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="rope type"):
        rope_spec_from_config({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert RopeSpec(theta=1.0).rope_type == "default"


# ---------------------------------------------------------------------------------------------------------------
# CUDA path (Triton kernels, CUDA graphs): tests marked gpu, skipped without a CUDA device.

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mixed_steps(driver, vocab):
    """Prefill 3 sequences, one of them in two chunks, one joining late, then decode; returns all logits."""
    g = torch.Generator().manual_seed(77)
    toks = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    out = [driver.step({0: toks(40), 1: toks(9)})]
    out.append(driver.step({0: toks(1), 1: toks(1), 2: toks(70)}))
    out.append(driver.step({0: toks(1), 1: toks(30), 2: toks(1)}))
    for _ in range(5):
        out.append(driver.step({s: toks(1) for s in (0, 1, 2)}))
    return [x for step in out for x in step.values()]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["qwen3", "qwen2-tied-yarn", "llama-bias-llama3-rope", "mistral-sliding-window"])
def test_cuda_model_matches_the_cpu_model(model_dirs, name):
    path = model_dirs(name)
    cpu, cuda = load_model(path), load_model(path, device="cuda")
    got = _mixed_steps(PagedDriver(cuda, block_size=16, num_blocks=40, seed=1, device="cuda"), cpu.arch.vocab_size)
    want = _mixed_steps(PagedDriver(cpu, block_size=16, num_blocks=40, seed=2), cpu.arch.vocab_size)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["qwen3", "qwen2"])
def test_cuda_bf16_logits_match_transformers_loosely(model_dirs, name):
    path = model_dirs(name, "bfloat16")
    ours = load_model(path, device="cuda")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    tokens = prompt(ours.arch.vocab_size, 300, seed=5)
    driver = PagedDriver(ours, block_size=16, num_blocks=40, seed=3, device="cuda")
    logits = torch.cat([driver.step({0: tokens[:200]})[0], driver.step({0: tokens[200:290]})[0]]
                       + [driver.step({0: [t]})[0] for t in tokens[290:]])
    with torch.no_grad():
        expected = ref(torch.tensor([tokens], device="cuda")).logits[0].float().cpu()
    assert (logits - expected).abs().max().item() < 0.1 * expected.std().item() + 0.1
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_cuda_greedy_generation_equals_transformers_generate(pair, model_dirs, name):
    _, ref = pair(name)
    ours = load_model(model_dirs(name), device="cuda")
    tokens = prompt(ours.arch.vocab_size, 11, seed=21)
    driver = PagedDriver(ours, block_size=16, num_blocks=8, seed=9, device="cuda")
    logits, out = driver.step({0: tokens})[0], []
    for _ in range(20):
        out.append(int(logits[-1].argmax()))
        if out[-1] in ours.arch.eos_token_ids:
            break
        logits = driver.step({0: [out[-1]]})[0]
    with torch.no_grad():
        want = ref.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                            max_new_tokens=20, do_sample=False, pad_token_id=ours.arch.eos_token_ids[0])
    assert out == want[0, len(tokens):].tolist()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager_decode(model_dirs, dtype):
    from token_engine.core.cuda_graphs import DecodeGraphs

    model = load_model(model_dirs("qwen3", dtype), device="cuda")
    arch = model.arch
    block_size, num_blocks = 16, 64
    pool = allocate_kv_pool(num_blocks, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, arch.dtype,
                            "cuda")
    pool.normal_()
    graphs = DecodeGraphs(model, pool, block_size, max_num_seqs=8, max_blocks_per_seq=8, batch_sizes=[1, 4, 8])
    graphs.capture()
    rng = random.Random(0)
    for n in (1, 3, 8, 5):
        blocks = rng.sample(range(num_blocks), n * 4)
        tables = [blocks[i * 4 : (i + 1) * 4] for i in range(n)]
        lens = [rng.randint(1, 64) for _ in range(n)]
        meta = build_metadata([1] * n, lens, tables, block_size, "cuda")
        ids = torch.randint(0, arch.vocab_size, (n,), device="cuda")
        positions = torch.tensor([x - 1 for x in lens], device="cuda")
        assert graphs.can_replay(meta)
        before = pool.clone()
        replayed = graphs.replay(ids, positions, meta).clone()
        after_replay = pool.clone()
        pool.copy_(before)
        with torch.no_grad():
            eager = model(ids, positions, meta, pool)
        assert torch.equal(pool, after_replay)  # same K/V written, nothing for the padded rows
        torch.testing.assert_close(replayed, eager, atol=1e-2 if dtype == "bfloat16" else 1e-4, rtol=1e-2)


@pytest.mark.gpu
@gpu
def test_cuda_graph_replays_equal_the_eager_step_exactly_every_time(model_dirs, monkeypatch):
    """A decode step of 8 sequences through the few-rows path with o and down split over K (their partial sums
    added by the norm after them) and decode attention that merges its slices in the last program of each
    group: replayed again and again, the graph gives exactly what the eager step gives, hidden states and the
    K/V written. A missing barrier or an unordered read would show as a difference in some replay."""
    from token_engine.core.cuda_graphs import DecodeGraphs
    from token_engine.layers import decode_linear_cuda as dl

    model = load_model(model_dirs("qwen2", "bfloat16"), device="cuda")
    layer = model.model.layers[0]
    for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
        monkeypatch.setitem(dl.SPLIT_TUNED, (*linear.weight.shape, 16), ((16, 32, 4, 2), 3))
    arch = model.arch
    pool = allocate_kv_pool(80, arch.num_layers, 16, arch.num_kv_heads, arch.head_dim, arch.dtype, "cuda")
    pool.normal_()
    tables = [list(range(i * 10, (i + 1) * 10)) for i in range(8)]
    lens = [150, 3, 77, 160, 16, 17, 99, 120]
    meta = build_metadata([1] * 8, lens, tables, 16, "cuda")
    ids = torch.randint(0, arch.vocab_size, (8,), device="cuda")
    positions = torch.tensor([x - 1 for x in lens], device="cuda")
    before = pool.clone()
    with torch.no_grad():
        eager = model(ids, positions, meta, pool)
    eager_pool = pool.clone()
    graphs = DecodeGraphs(model, pool, 16, max_num_seqs=8, max_blocks_per_seq=10, batch_sizes=[8])
    graphs.capture()
    for _ in range(20):
        pool.copy_(before)
        assert torch.equal(graphs.replay(ids, positions, meta), eager)
        assert torch.equal(pool, eager_pool)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["qwen3", "mistral-sliding-window"])
def test_cuda_mixed_step_graph_replay_equals_the_eager_step(model_dirs, name):
    """Prefill chunks next to decodes, padded into a captured graph: the same hidden states and the same K/V
    written as the eager forward, a smaller step after a larger one included; the start-up check passes."""
    from token_engine.core.mixed_graphs import VERIFY_TOLERANCE, MixedGraphs

    model = load_model(model_dirs(name), device="cuda")
    arch = model.arch
    block_size, num_blocks = 16, 96
    pool = allocate_kv_pool(num_blocks, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, arch.dtype,
                            "cuda")
    pool.normal_()
    graphs = MixedGraphs(model, pool, block_size, max_num_seqs=8, max_blocks_per_seq=12,
                         max_num_batched_tokens=200)
    graphs.capture()
    assert graphs.verify() <= VERIFY_TOLERANCE
    rng = random.Random(0)
    for cached, new in (([0, 30, 100, 7], [50, 1, 60, 1]), ([64, 5], [1, 17]), ([0], [120])):
        lens = [c + n for c, n in zip(cached, new)]
        blocks = rng.sample(range(num_blocks), sum(-(-n // block_size) for n in lens))
        tables, at = [], 0
        for n in lens:
            tables.append(blocks[at : at + -(-n // block_size)])
            at += len(tables[-1])
        ids = [rng.randrange(arch.vocab_size) for _ in range(sum(new))]
        positions = [p for c, n in zip(cached, new) for p in range(c, c + n)]
        cpu_meta = build_metadata(new, lens, tables, block_size, "cpu")
        key = graphs.key_for(new, int(cpu_meta.block_tables.shape[1]))
        assert key is not None
        before = pool.clone()
        replayed = graphs.replay(key, ids, positions, cpu_meta, new)[0].clone()
        after_replay = pool.clone()
        pool.copy_(before)
        with torch.no_grad():
            eager = model(torch.tensor(ids, device="cuda"), torch.tensor(positions, device="cuda"),
                          build_metadata(new, lens, tables, block_size, "cuda"), pool)
        torch.testing.assert_close(pool, after_replay, atol=1e-4, rtol=1e-4)  # padded rows write nothing
        torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=1e-3)
    # What the step budget plans with: every bucket timed at two contexts, the pool left as it was.
    before = pool.clone()
    times = graphs.time_buckets(context=100)
    assert list(times) == graphs.layout.token_buckets
    assert all(ms > 0 and per_thousand >= 0 for ms, per_thousand in times.values())
    assert torch.equal(pool, before)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("name", ["qwen2", "llama-bias-llama3-rope"])
def test_cuda_few_rows_kernels_match_the_plain_path(model_dirs, name, split, monkeypatch):
    """Steps of <= 32 tokens take decode_linear_cuda (SiLU folded into gate_up; with `split`, o and down write
    partial sums over K slices that the norm after them adds up); the same steps through cuBLAS and the separate
    kernels give the same logits."""
    from token_engine.layers import decode_linear_cuda as dl

    model = load_model(model_dirs(name), device="cuda")
    if split:  # the tuned table holds the 7B shapes only: give this model's o and down a split
        layer = model.model.layers[0]
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            for rows_pad in (16, 32):
                monkeypatch.setitem(dl.SPLIT_TUNED, (*linear.weight.shape, rows_pad), ((16, 32, 4, 2), 3))
    vocab = model.arch.vocab_size
    few = _mixed_steps(PagedDriver(model, block_size=16, num_blocks=40, seed=1, device="cuda"), vocab)
    model.model.few_rows_kernels = False
    plain = _mixed_steps(PagedDriver(model, block_size=16, num_blocks=40, seed=1, device="cuda"), vocab)
    for a, b in zip(few, plain):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
