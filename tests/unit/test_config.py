import pytest
import torch
from conftest import run_main

from rlsync.config.derived import bucket_bytes
from rlsync.config.schema import Config
from rlsync.model.build import build_model, hf_config, model_bytes, named_weights

# (model, hidden, layers, heads, tied, bf16 bytes with tied weights counted once)
MODELS = [
    ("tiny", 256, 4, 4, True, None),
    ("qwen3_0p6b", 1024, 28, 16, True, 1_192_099_840),
    ("qwen3_1p7b", 2048, 28, 16, True, None),
    ("qwen3_4b", 2560, 36, 32, True, None),
    ("qwen3_8b", 4096, 36, 32, False, None),
]


@pytest.mark.parametrize("name,hidden,layers,heads,tied,nbytes", MODELS)
def test_every_model_composes_to_its_published_architecture(compose, name, hidden, layers, heads, tied, nbytes):
    cfg = compose(f"model={name}")
    assert isinstance(cfg, Config)
    m = cfg.model
    assert (m.name, m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.tie_word_embeddings) == (
        name,
        hidden,
        layers,
        heads,
        tied,
    )
    if name != "tiny":
        assert (m.vocab_size, m.head_dim, m.num_key_value_heads) == (151936, 128, 8)
    if nbytes:
        from transformers import Qwen3ForCausalLM

        with torch.device("meta"):
            model = Qwen3ForCausalLM(hf_config(m))
        assert model_bytes(model, torch.bfloat16) == nbytes
        assert len(named_weights(model)) == 310  # 28 layers x 11 + embedding + final norm; lm_head tied


def test_sizes_match_design_notes(compose):
    from transformers import Qwen3ForCausalLM

    for name, gib in [("qwen3_1p7b", 3.20), ("qwen3_4b", 7.49), ("qwen3_8b", 15.26)]:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(hf_config(compose(f"model={name}").model))
        assert model_bytes(model, torch.bfloat16) / 2**30 == pytest.approx(gib, abs=0.01)


def test_overrides_reach_the_typed_tree(compose):
    cfg = compose("update.bucket_mb=128", "rollout.max_response_len=256", "trainer.kl_coef=0.1")
    assert cfg.update.bucket_mb == 128 and bucket_bytes(cfg.update) == 128 * 2**20
    assert cfg.rollout.max_response_len == 256 and cfg.trainer.kl_coef == 0.1
    assert compose("rollout=reference").rollout.max_response_len == 256


def test_default_bucket_is_the_reference_buffer_size(compose):
    assert bucket_bytes(compose().update) == 536870912


@pytest.mark.parametrize("override", ["update.bucket_size=3", "model.hidden_size=big", "model=qwen9"])
def test_schema_rejects_unknown_keys_and_wrong_types(compose, override):
    with pytest.raises(Exception):  # noqa: B017 - Hydra raises a different error type for each case
        compose(override)


def test_random_build_is_seeded_and_tied():
    cfg = Config().model
    a = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), seed=1)
    b = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), seed=1)
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name
    assert a.lm_head.weight is a.model.embed_tokens.weight
    w = a.model.layers[0].mlp.up_proj.weight
    assert 0.015 < w.std().item() < 0.025 and torch.isfinite(w).all()


def one_config_error(proc) -> str:
    """The command's one line: a config error, exit 2, nothing else on stderr."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("rlsync: config error: "), line
    return line


@pytest.mark.parametrize(
    "module, override, says",
    [
        # C006: 10^23 steps ran until killed
        (
            "rlsync",
            "run.steps=99999999999999999999999",
            "run.steps=99999999999999999999999: out of range (allowed: 1 to 1000000",
        ),
        ("rlsync.bench", "bench.repeats=10000000", "bench.repeats=10000000: out of range (allowed: 1 to 1000000"),
        ("rlsync.bench", "bench.warmup=10000000", "bench.warmup=10000000: out of range (allowed: 0 to 1000000"),
    ],
)
def test_a_count_no_run_takes_is_refused(tmp_path, module, override, says):
    assert says in one_config_error(run_main(override, f"hydra.run.dir={tmp_path}", module=module))
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("group", ["model", "rollout", "scheme"])
def test_a_deleted_group_is_refused_as_null_is(tmp_path, group):
    """C070: `~model` composed the schema's defaults and ran the tiny model, exit 0, while model=null was refused."""
    line = one_config_error(run_main(f"~{group}", f"hydra.run.dir={tmp_path}"))
    assert line.startswith(f"rlsync: config error: {group}=null: deleted by ~{group} (the run needs one) (allowed: ")
    null = one_config_error(run_main(f"{group}=null", f"hydra.run.dir={tmp_path}"))
    assert null.split(" (allowed: ")[1] == line.split(" (allowed: ")[1]  # the same choices offered


@pytest.mark.parametrize(
    "target, override, applies_to",
    [
        ("offload", "bench.changed_ratio=0.5", "update"),  # P62
        ("update", "bench.offload_state=params", "offload"),
        ("update", "bench.clients=4", "stall"),
        ("offload", "bench.policies=[stage]", "stall"),
    ],
)
def test_a_bench_key_its_target_does_not_read_is_refused(tmp_path, target, override, applies_to):
    line = one_config_error(
        run_main(f"bench.target={target}", override, f"hydra.run.dir={tmp_path}", module="rlsync.bench")
    )
    assert line.startswith(f"rlsync: config error: {override}: does nothing with bench.target={target} ")
    assert line.endswith(f"with bench.target={target}; it applies to bench.target={applies_to})"), line


def test_a_bench_key_set_to_its_default_is_no_change():
    from rlsync.config.apps import BenchAppConfig
    from rlsync.config.validate import validate

    cfg = BenchAppConfig()
    cfg.bench.target, cfg.bench.changed_ratio, cfg.bench.policies = "offload", 0.0, ["pause", "stage"]
    validate(cfg)


def test_no_config_of_rlsync_sets_hydras_mode_or_search_path():
    """rlsync.config.compose.run_mode answers Hydra's run mode without composing because no file under
    rlsync/conf sets hydra.mode or hydra.searchpath (at the top level, or under a `_global_` or `hydra` package)."""
    import yaml

    from rlsync.errors import CONF_DIR

    files = sorted(CONF_DIR.rglob("*.yaml"))
    assert len(files) > 20
    for path in files:
        text = path.read_text()
        node = yaml.safe_load(text) or {}
        hydra = node if "@package hydra" in text else node.get("hydra") or {}
        assert not {"mode", "searchpath"} & set(hydra), path


@pytest.mark.parametrize(
    "config_name,overrides",
    [
        ("config", ["update.bucket_mb=0", "~hydra.callbacks.sweep_report"]),  # a single run, refused later
        ("config", ["model=qwen9"]),  # composition fails: None, as Hydra's own answer
        ("bench", ["+experiment=delta", "update.transport=direct,ipc"]),  # a sweep's overrides
        ("config", ["hydra.mode=MULTIRUN"]),  # set by an override: Hydra composes and reads it
        ("plan", ["+hydra.mode=RUN"]),
        ("engine", ["hydra.searchpath=[pkg://rlsync.conf]"]),  # other configs searched: Hydra composes
    ],
)
def test_the_run_mode_is_hydras_own_answer_with_one_composition(monkeypatch, config_name, overrides):
    """An entry point composes its config once (not once for Hydra's run mode and again for the run): the mode
    rlsync.config.compose.run_mode answers is the one Hydra's own composition gives, composing only where an
    override can change it."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from rlsync.config import compose

    composed = []
    with initialize_config_module(config_module="rlsync.conf", version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        compose.register_configs()
        real = hydra.config_loader.load_configuration
        monkeypatch.setattr(
            hydra.config_loader, "load_configuration", lambda *a, **k: composed.append(1) or real(*a, **k)
        )
        answer = compose.run_mode(hydra, config_name, list(overrides))
        fast = len(composed)
        assert answer == compose.compose_for_mode(hydra, config_name, list(overrides))
    assert fast == (1 if any("hydra.mode" in o or "hydra.searchpath" in o for o in overrides) else 0)


def test_a_refused_value_is_composed_once_in_process(monkeypatch):
    """`python -m rlsync update.bucket_mb=0` composes its config once: Hydra's own run mode composed it twice."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    calls = []
    real = ConfigLoaderImpl.load_configuration
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", lambda *a, **k: calls.append(1) or real(*a, **k))
    result = run_main("update.bucket_mb=0")
    assert result.returncode == 2 and result.stderr.startswith("rlsync: config error: update.bucket_mb=0"), result
    assert len(calls) == 1
