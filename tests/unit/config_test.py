"""The config system as users meet it: files, flags, --help, --dry-run and errors."""

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from prime_rl.config.cli import ConfigError, parse_config
from prime_rl.config.defaults import DEFAULT_MODEL
from prime_rl.environments import env_module_name
from prime_rl.inference.config import FALLBACK_MAX_MODEL_LEN, InferenceConfig
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.preflight import check_rl
from prime_rl.model.local import max_model_len
from prime_rl.model.tiny import TinyModelConfig
from prime_rl.orchestrator.advantages.base import CustomAdvantage
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.preflight import check_orchestrator
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.preflight import check_trainer
from prime_rl.trainer.reward_model.config import RewardModelTrainConfig
from prime_rl.trainer.sft.config import SFTConfig

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse_error(cls, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_config(cls, argv, prog="prog")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_defaults_then_files_then_flags(tmp_path):
    a = write(tmp_path, "a.toml", "max_steps = 5\n[optim]\nlr = 0.1\nweight_decay = 0.5\n")
    b = write(tmp_path, "b.toml", "[optim]\nlr = 0.2\n")
    config = parse_config(TrainerConfig, ["@", str(a), f"@{b}", "--seed", "7"])
    assert config.max_steps == 5  # from a
    assert config.optim.lr == 0.2  # b wins over a
    assert config.optim.weight_decay == 0.5  # tables deep-merge: a's other keys stay
    assert config.seed == 7  # flag
    assert config.seq_len == TrainerConfig().seq_len  # default
    config = parse_config(TrainerConfig, ["@", str(a), "--optim.lr", "1e-5"])
    assert config.optim.lr == 1e-5  # flags win over files


def test_boolean_flags_and_structured_values():
    config = parse_config(TrainerConfig, ["--model.activation-checkpointing"])
    assert config.model.activation_checkpointing is True
    config = parse_config(
        TrainerConfig, ["--model.activation-checkpointing", "--no-model.activation-checkpointing"]
    )
    assert config.model.activation_checkpointing is False
    config = parse_config(TrainerConfig, ["--optim.betas", "[0.8, 0.9]", "--ckpt.interval=3"])
    assert config.optim.betas == (0.8, 0.9) and config.ckpt.interval == 3
    config = parse_config(OrchestratorConfig, ["--advantage", '{type = "m:f"}'])
    assert isinstance(config.advantage, CustomAdvantage)


def test_unknown_key_names_it_and_suggests(tmp_path, capsys):
    err = parse_error(TrainerConfig, ["--optim.lrr", "1"], capsys)
    assert "unknown key 'optim.lrr'" in err and "Did you mean 'optim.lr'" in err
    f = write(tmp_path, "t.toml", "[optim]\nweight_decai = 0.1\n")
    err = parse_error(TrainerConfig, ["@", str(f)], capsys)
    assert "optim.weight_decai" in err and str(f) in err and "optim.weight_decay" in err
    # A key at the wrong level is pointed to where it lives.
    err = parse_error(RLConfig, ["--lr", "1"], capsys)
    assert "trainer.optim.lr" in err


def test_wrong_type_and_bad_files(tmp_path, capsys):
    err = parse_error(TrainerConfig, ["--max-steps", "many"], capsys)
    assert "max_steps" in err and "'many'" in err and "integer" in err
    err = parse_error(TrainerConfig, ["@", str(tmp_path / "missing.toml")], capsys)
    assert "missing.toml" in err and "not found" in err
    bad = write(tmp_path, "bad.toml", "max_steps = = 3\n")
    err = parse_error(TrainerConfig, ["@", str(bad)], capsys)
    assert "bad.toml" in err and "not valid TOML" in err
    err = parse_error(TrainerConfig, ["stray"], capsys)
    assert "'stray'" in err


def test_rl_hands_shared_fields_down():
    config = parse_config(
        RLConfig, ["--max-steps", "7", "--model", "m", "--output-dir", "out", "--seq-len", "64"]
    )
    for sub in (config.trainer, config.orchestrator):
        assert (sub.max_steps, sub.model.name, str(sub.output_dir), sub.seq_len) == (7, "m", "out", 64)
    assert config.inference.model.name == "m"
    # One section repeating the value is fine; it is then taken everywhere.
    config = parse_config(RLConfig, ["--trainer.max-steps", "9"])
    assert config.max_steps == config.orchestrator.max_steps == 9


def test_rl_rejects_conflicting_shared_values(capsys):
    err = parse_error(RLConfig, ["--max-steps", "7", "--trainer.max-steps", "8"], capsys)
    assert "conflicting values for the shared setting 'max_steps'" in err
    assert "trainer.max_steps" in err
    err = parse_error(RLConfig, ["--trainer.model.name", "a", "--orchestrator.model.name", "b"], capsys)
    assert "'model'" in err


def test_every_field_has_a_docstring():
    from prime_rl.config.schema import leaf_paths
    from prime_rl.trainer.weights.export_lora import ExportLoRAConfig

    for cls in (RLConfig, TrainerConfig, OrchestratorConfig, TinyModelConfig, ExportLoRAConfig):
        missing = [".".join(p) for p, info in leaf_paths(cls) if not (info.description or "").strip()]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_dry_run_output_reads_back_to_the_same_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(RLConfig, ["@", str(REPO / "configs/reverse_text/rl.toml"), "--dry-run"])
    assert exc.value.code == 0
    dumped = write(tmp_path, "resolved.toml", capsys.readouterr().out)
    again = parse_config(RLConfig, ["@", str(dumped)])
    assert again == parse_config(RLConfig, ["@", str(REPO / "configs/reverse_text/rl.toml")])


@pytest.mark.parametrize("script", ["rl", "orchestrator", "trainer", "inference", "sft"])
def test_console_scripts_help(script):
    exe = Path(sys.executable).parent / script
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "--" in out.stdout
    # Every field's docstring is shown (spot check one per script).
    assert "[default:" in out.stdout


def test_required_settings_say_so_in_help():
    out = subprocess.run(
        [Path(sys.executable).parent / "export-lora", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--adapter PATH" in out.stdout
    assert "[required]" in out.stdout and "Undefined" not in out.stdout


def test_console_script_user_error_exits_2_without_traceback():
    exe = Path(sys.executable).parent / "rl"
    out = subprocess.run(
        [exe, "@", str(REPO / "configs/reverse_text/rl.toml"), "--trainer.optim.lrr", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "trainer.optim.lrr" in out.stderr and "Traceback" not in out.stderr


def test_max_model_len_defaults_to_the_models_own_limit(short_context_model):
    assert InferenceConfig(model={"name": str(short_context_model)}).model.max_model_len == 512
    assert RLConfig(model=str(short_context_model)).inference.model.max_model_len == 512
    shipped = REPO / "models/reverse_text-tiny"
    positions = json.loads((shipped / "config.json").read_text())["max_position_embeddings"]
    assert InferenceConfig(model={"name": str(shipped)}).model.max_model_len == positions
    # A hub id is not read here (no download, no import of transformers): the fallback.
    assert InferenceConfig(model={"name": "org/model"}).model.max_model_len == FALLBACK_MAX_MODEL_LEN


def test_seq_len_may_exceed_the_model_context_but_max_tokens_may_not(short_context_model):
    """A micro-batch packs many samples, each restarting its positions: seq_len is not bounded by
    the model's 512 positions; a completion budget that leaves no room for a prompt is."""
    config = RLConfig(model=str(short_context_model), seq_len=4096)
    assert config.trainer.seq_len == config.orchestrator.seq_len == 4096
    assert config.inference.model.max_model_len == 512
    with pytest.raises(
        ValidationError, match=r"'orchestrator.envs\[0\].sampling.max_tokens' = 512 leaves no room"
    ):
        RLConfig(model=str(short_context_model), seq_len=4096,
                 orchestrator={"envs": [{"id": "reverse-text", "sampling": {"max_tokens": 512}}]})  # fmt: skip


POSITIONS = "max_position_embeddings in its config.json"
ROPE_LINEAR = {"rope_scaling": {"type": "linear", "factor": 4.0}}  # vLLM scales the length by it
ROPE_YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}  # already scaled: vLLM does not


@pytest.mark.parametrize(
    ("config", "tokenizer_max", "expected"),
    [
        ({"max_position_embeddings": 2048, "max_seq_len": 1000}, None,
         (1000, "max_seq_len in its config.json")),
        ({"text_config": {"max_position_embeddings": 700}}, None, (700, POSITIONS)),
        ({"max_position_embeddings": 2048, **ROPE_LINEAR}, None, (8192, POSITIONS)),
        ({"max_position_embeddings": 2048, **ROPE_YARN}, None, (2048, POSITIONS)),
        ({"max_position_embeddings": 2048}, 300, (300, "model_max_length in its tokenizer_config.json")),
        ({"hidden_size": 8}, None, None),
    ],
)  # fmt: skip
def test_the_models_limit_is_read_as_vllm_derives_it(tmp_path, config, tokenizer_max, expected):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    if tokenizer_max:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": tokenizer_max}))
    assert max_model_len(str(tmp_path)) == expected


def test_max_model_len_and_completion_budgets_beyond_it_are_named(short_context_model, capsys):
    model = ["--model", str(short_context_model)]
    err = parse_error(RLConfig, [*model, "--inference.model.max-model-len", "513"], capsys)
    assert "'inference.model.max_model_len' = '513'" in err and "512 tokens" in err
    envs = '[{id = "reverse-text", sampling = {max_tokens = 512}}]'
    # (seq_len, the packed micro-batch, may exceed it: it is not named.)
    err = parse_error(RLConfig, [*model, "--seq-len", "600", "--orchestrator.eval.envs", envs], capsys)
    assert "'orchestrator.eval.envs[0].sampling.max_tokens' = 512" in err and "seq_len" not in err
    assert "'inference.model.max_model_len' = 512" in err and len(err.strip().splitlines()) == 2
    config = parse_config(RLConfig, [*model, "--seq-len", "256", "--inference.model.max-model-len", "256"])
    assert config.inference.model.max_model_len == 256


def test_env_module_name_follows_verifiers():
    import verifiers.v1 as vf

    for env_id in ("reverse-text", "owner/reverse-text", "owner/Reverse-Text@0.1.0", "tool_add"):
        assert vf.import_taskset(env_id).__name__ == env_module_name(env_id)


@pytest.mark.parametrize(
    "path", sorted(REPO.glob("configs/**/*.toml")), ids=lambda p: str(p.relative_to(REPO))
)
def test_every_shipped_config_parses_and_passes_the_checks(path, monkeypatch):
    monkeypatch.chdir(REPO)  # their model paths are relative to the repo
    if path.parent.name == "algorithms":  # overlays on an env's rl.toml
        parse_config(RLConfig, ["@", "configs/sum_digits/rl.toml", "@", str(path)], check=check_rl)
        return
    if path.name.startswith("rl_"):  # overlays on the rl.toml beside them
        # A model its header says to build first (not committed, e.g. the real-vocab preset): the
        # rest of the config must still parse and pass the checks.
        model = tomllib.loads(path.read_text()).get("model", "")
        built = [] if not model or Path(model).exists() else ["--model", "models/reverse_text-tiny"]
        assert not built or "make-tiny-model --preset" in path.read_text(), (
            f"{model} is neither committed nor built"
        )
        parse_config(RLConfig, ["@", str(path.parent / "rl.toml"), "@", str(path), *built], check=check_rl)
        return
    kind = "sft.toml" if path.name.endswith("sft.toml") else path.name
    cls, check = {"rl.toml": (RLConfig, check_rl), "orchestrator.toml": (OrchestratorConfig, check_orchestrator),
                  "trainer.toml": (TrainerConfig, check_trainer), "inference.toml": (InferenceConfig, None),
                  "sft.toml": (SFTConfig, None), "reward_model.toml": (RewardModelTrainConfig, None)}[kind]  # fmt: skip
    parse_config(cls, ["@", str(path)], check=check)


DISTILL = {"orchestrator": {"filters": []}, "trainer": {"advantage": {"type": "reinforce"}}}
NODES = [
    {"host": "10.0.0.1", "roles": ["inference", "orchestrator"]},
    {"host": "10.0.0.2", "roles": ["inference"]},
    {"host": "10.0.0.3", "roles": ["trainer"]},
    {"host": "10.0.0.4", "roles": ["trainer"]},
]


@pytest.mark.parametrize(
    "deployment, message",
    [
        ({"nodes": NODES, "node": 4}, "'deployment.node' = 4 is not an index"),
        ({"node": 1}, "'deployment.node' = 1 needs 'deployment.nodes'"),
        (
            {"nodes": [{"host": "a", "roles": ["inference", "trainer"]}]},
            "exactly one node has the role 'orchestrator'",
        ),
        (
            {"nodes": [{"host": "a", "roles": ["orchestrator", "trainer"]}]},
            "no node has the role 'inference'",
        ),
        ({"nodes": [{"host": "a", "roles": []}]}, "roles"),
    ],
)
def test_bad_deployments_are_named(deployment, message):
    with pytest.raises(ValueError, match=message):
        RLConfig(deployment=deployment)


ENGINE = {"inference_mode": "engine"}


@pytest.mark.parametrize(
    "config, message",
    [
        ({"deployment": {**ENGINE, "nodes": NODES}}, "deployment.nodes is set"),
        (
            {"deployment": {**ENGINE, "inference_urls": ["http://10.0.0.5:8000"]}},
            "deployment.inference_urls is set",
        ),
        ({"deployment": {**ENGINE, "inference_servers": 2}}, "deployment.inference_servers = 2"),
        ({"deployment": ENGINE, "trainer": {"lora": {"rank": 8}}}, r"\[trainer.lora\] is set"),
        ({"deployment": ENGINE, "orchestrator": {"env_workers": 1}}, "orchestrator.env_workers = 1"),
        (
            {"deployment": ENGINE, "trainer": {"weight_broadcast": {"type": "collective"}}},
            "trainer.weight_broadcast.type = 'collective'",
        ),
    ],
)
def test_engine_mode_names_what_it_cannot_serve(config, message):
    with pytest.raises(
        ValueError, match=rf"'deployment.inference_mode' = 'engine' cannot serve this run: {message}"
    ):
        RLConfig(**config)
    RLConfig(deployment=ENGINE)  # one machine, one server, full weights: served


@pytest.mark.parametrize(
    "config, message",
    [
        ({"engine": {"model": {"name": "other"}}}, r"'engine.model.name' = 'other' must be the model"),
        ({"engine": {}, "env_workers": 2}, "set env_workers = 0"),
        ({"engine": {}, "lora_adapter": "run"}, "full weights only"),
    ],
)
def test_an_orchestrator_with_the_engine_in_its_process_names_what_conflicts(config, message):
    with pytest.raises(ValueError, match=message):
        OrchestratorConfig(**config)


def test_a_classic_env_is_named_with_the_way_to_port_it():
    classic = [{"id": "classic-env", "sampling": {"max_tokens": 16}}]
    with pytest.raises(
        ConfigError,
        match=r"envs\[0\]\.id = 'classic-env': module 'classic_env' .* is a classic verifiers env",
    ):
        check_orchestrator(OrchestratorConfig(envs=classic))
    check_orchestrator(
        OrchestratorConfig(engine={}, envs=[{"id": "v1_test_env"}])
    )  # the engine plays v1 envs


def test_the_teacher_may_not_take_a_policy_servers_port():
    with pytest.raises(ValueError, match=r"'teacher\.server\.port' = 8001 is a policy server's port"):
        RLConfig(deployment={"inference_servers": 2}, teacher={"model": {"name": DEFAULT_MODEL}, "server": {"port": 8001}},
                 **DISTILL)  # fmt: skip


SRC = REPO / "src" / "prime_rl"
CONFIG_MODULES = sorted(
    ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in SRC.rglob("*.py")
    if p.stem == "config" or p.stem.endswith("_config") or p.parent == SRC / "config"
)
"""Every config module (`config.py`, `*_config.py`) and the config machinery (`prime_rl/config/`)."""
HEAVY = ("torch", "transformers", "zmq", "numpy")


def test_the_config_modules_are_found():
    assert {"prime_rl.config", "prime_rl.config.defaults", "prime_rl.config.plugins", "prime_rl.launcher.config",
            "prime_rl.inference.config", "prime_rl.transport.config", "prime_rl.trainer.losses.config",
            "prime_rl.orchestrator.envs_config"} <= set(CONFIG_MODULES)  # fmt: skip


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_a_config_imports_nothing_heavy_and_no_trainer_runtime(module):
    """`rl`, `--help` and preflight read configs only: they must not pay for torch, nor for the
    transports' zmq and numpy. A built-in's function is imported when a trainer builds it, so only
    config modules (and their packages) of the trainer may load. Each module in a fresh interpreter,
    so that none is excused by what another loaded."""
    code = (
        f"import json, sys, {module}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}"
        " or m.startswith('prime_rl.trainer.'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout)
    heavy = sorted({m.split(".")[0] for m in loaded if not m.startswith("prime_rl.")})
    runtime = [m for m in loaded if m.startswith("prime_rl.") and not m.endswith(".config")
               and importlib.util.find_spec(m).submodule_search_locations is None]  # fmt: skip
    assert not heavy and not runtime, {"heavy": heavy, "trainer runtime": runtime}
