"""EPID_* parsing: defaults, accepted spellings, and one clear error per bad value."""

import dataclasses
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from epid.config.load import (
    VARIABLE_OF_FIELD,
    VARIABLES,
    Config,
    help_text,
    load_config,
    markdown_table,
    recipe_defaults,
)
from epid.config.variables import ConfigError
from epid.core.errors import InputError
from epid.models import families
from epid.synthesis.mlc import MLC_GEOMETRIES
from epid.synthesis.physics import PRESETS, Physics
from tests.support import ROOT, clean_environment

LEGACY = {"EPID_MODEL": "legacy"}


def test_the_legacy_family_trains_with_the_variables_own_defaults_the_legacy_run():
    config = load_config(LEGACY)
    assert config == dataclasses.replace(Config(), model="legacy", batch_size=128)
    assert config.world_size == 1
    assert config.batch_size == 128
    assert config.dataset_shuffle is True
    assert config.dataset_seed == 12345
    assert config.dataset_ids == tuple(range(640))
    assert config.num_workers == 0 and config.pin_memory is True and config.prefetch_factor == 2
    assert config.timing_every == 0 and config.timing_max == 1
    assert config.epochs == 2000 and config.control_points == 2050
    assert config.noise_std == 0.005 and config.lr == 1e-4 and config.weight_decay == 1e-4
    assert config.checkpoint_path == "checkpoints/epid_checkpoint.pth"
    assert config.device == "auto" and config.kernel == "" and config.cache_dir == ""


def test_the_default_family_brings_its_recipe_where_variables_are_unset():
    config = load_config({})
    assert config.model == families.DEFAULT_FAMILY == "aperture"
    recipe = families.FAMILIES["aperture"].recipe
    assert (config.batch_size, config.batch_order, config.lr) == (8, "shuffled", 2e-3)
    assert (config.lr_schedule, config.lr_update, config.warmup_steps, config.grad_clip) == ("cosine", "step", 50, 1.0)
    assert load_config(recipe) == config
    for name, text in recipe.items():  # everything else is the variable's own default
        variable = next(item for item in VARIABLES if item.name == name)
        assert getattr(config, variable.field) == variable.parse(text)
    others = [item for item in VARIABLES if item.name not in recipe and item.field != "model"]
    assert all(getattr(config, item.field) == getattr(load_config(LEGACY), item.field) for item in others)
    # a value the user sets wins; the recipe's warm-up in steps gives way to a warm-up in epochs
    assert load_config({"EPID_LR": "5e-4", "EPID_BATCH_SIZE": "16"}).lr == 5e-4
    assert load_config({"EPID_BATCH_SIZE": "16"}).batch_size == 16
    by_epoch = load_config({"EPID_WARMUP_EPOCHS": "2"})
    assert (by_epoch.warmup_epochs, by_epoch.warmup_steps, by_epoch.lr_update) == (2, 0, "step")
    assert load_config({"EPID_LR_UPDATE": "epoch"}).warmup_steps == 0
    assert "default 0.0001; aperture 2e-3" in help_text()


def test_every_variable_is_a_config_field_with_its_default():
    fields = {field.name: field for field in dataclasses.fields(Config)}
    assert [variable.field for variable in VARIABLES] == [name for name in fields if name in {
        variable.field for variable in VARIABLES}]
    assert set(fields) - {variable.field for variable in VARIABLES} == {"dataset_ids", "plan_arcs",
                                                                        "launched_by_torchrun", "mlc_geometry"}
    defaults = Config()
    for variable in VARIABLES:
        assert getattr(defaults, variable.field) == variable.default, variable.name
        assert variable.parse(variable.example) is not None, variable.name
        if not variable.derived_when_unset and variable.default != "":
            # the default the table and --help show reads back as the config's default
            assert variable.parse(variable.shown_default) == variable.default, variable.name


@pytest.mark.parametrize("world_size, batch", [(1, 128), (2, 64), (3, 42), (8, 16)])
def test_default_batch_is_128_over_world_size(world_size, batch):
    config = load_config({**LEGACY, "EPID_WORLD_SIZE": str(world_size)})
    assert config.batch_size == batch
    assert load_config({"EPID_WORLD_SIZE": str(world_size), "EPID_BATCH_SIZE": "128"}).batch_size == 128


@pytest.mark.parametrize("word, value", [("1", True), ("TRUE", True), ("Yes", True), ("on", True),
                                          ("0", False), ("false", False), ("NO", False), ("Off", False)])
def test_booleans_accept_common_spellings(word, value):
    assert load_config({"EPID_PIN_MEMORY": word}).pin_memory is value
    assert load_config({"EPID_DATASET_SHUFFLE": word}).dataset_shuffle is value


def test_empty_value_means_default():
    assert load_config({"EPID_WORLD_SIZE": "", "EPID_LR": "  "}) == load_config({})


def test_selection_and_kernel_spec(tmp_path):
    kernel = tmp_path / "k.mat"
    kernel.write_bytes(b"placeholder")
    config = load_config({"EPID_DATASET_RANGE": "0:640:80", "EPID_KERNEL": f"{kernel}:measured"})
    assert config.dataset_ids == (0, 80, 160, 240, 320, 400, 480, 560)
    assert config.kernel_path == str(kernel) and config.kernel_variable == "measured"
    assert load_config({"EPID_KERNEL": str(kernel)}).kernel_variable is None


@pytest.mark.parametrize("spec, path, variable", [
    (r"C:\kernels\epid.mat", r"C:\kernels\epid.mat", None),
    (r"C:\kernels\epid.mat:k", r"C:\kernels\epid.mat", "k"),
    ("C:/kernels/epid.mat", "C:/kernels/epid.mat", None),
    ("epid.mat:", "epid.mat", None),
])
def test_kernel_spec_handles_windows_drives(spec, path, variable):
    config = Config(kernel=spec)
    assert (config.kernel_path, config.kernel_variable) == (path, variable)


def test_learning_rate_scaling():
    base = {"EPID_WORLD_SIZE": "2", "EPID_BATCH_SIZE": "128", "EPID_LR": "1e-4"}
    assert load_config(base).effective_lr == pytest.approx(1e-4)
    assert load_config({**base, "EPID_LR_SCALING": "linear"}).effective_lr == pytest.approx(2e-4)
    assert load_config({**base, "EPID_LR_SCALING": "sqrt"}).effective_lr == pytest.approx(math.sqrt(2) * 1e-4)


def test_torchrun_world_size_wins_and_conflicts_are_named():
    torchrun = {**LEGACY, "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    config = load_config(torchrun)
    assert config.world_size == 4 and config.batch_size == 32 and config.launched_by_torchrun
    with pytest.raises(ConfigError, match=r"^EPID_WORLD_SIZE='2': torchrun set WORLD_SIZE=4"):
        load_config({**torchrun, "EPID_WORLD_SIZE": "2"})


def test_round_trip_through_dict():
    config = load_config({"EPID_DATASET_IDS": "3,1", "EPID_LR": "3e-4"})
    assert Config.from_dict(config.to_dict()) == config
    assert Config.from_dict({**config.to_dict(), "field_of_a_later_release": 1}) == config


def bad_values(tmp_path):
    """A bad value for every variable, with a fragment its error must contain."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    return {
        "EPID_WORLD_SIZE": ("0", "an integer >= 1"),
        "EPID_BATCH_SIZE": ("-4", "an integer >= 1"),
        "EPID_DATASET_SHUFFLE": ("maybe", "1/0, true/false or yes/no"),
        "EPID_DATASET_SEED": ("1.5", "not an integer"),
        "EPID_DATASET_RANGE": ("0:640:0", "step cannot be 0; expected start:stop[:step]"),
        "EPID_DATASET_IDS": ("1,999", "outside 0..639"),
        "EPID_PLANS": (str(tmp_path / "missing"), "no such folder (expected a folder of RT Plan files)"),
        "EPID_DEVICE": ("tpu", "auto, cpu, cuda or cuda:N"),
        "EPID_BACKEND": ("mpi", "auto, nccl or gloo"),
        "EPID_THREADS": ("-1", "an integer >= 0"),
        "EPID_DRY_RUN": ("2", "1/0, true/false or yes/no"),
        "EPID_CONTROL_POINTS": ("3", "an integer >= 4"),
        "EPID_KERNEL": (str(tmp_path / "missing.mat"), "no file"),
        "EPID_MLC": ("hd121", "no built-in MLC of that name and no such file"),
        "EPID_NOISE_STD": ("-0.1", "a number >= 0"),
        "EPID_PHYSICS": ("real", "ideal or realistic"),
        "EPID_LEAF_TRANSMISSION_PERCENT": ("25", "a number in 0..20"),
        "EPID_JAW_TRANSMISSION_PERCENT": ("-0.1", "a number in 0..20"),
        "EPID_X_JAW_TRANSMISSION_PERCENT": ("21", "a number in 0..20"),
        "EPID_LEAF_END_OFFSET_MM": ("5", "a number in 0..3"),
        "EPID_TONGUE_GROOVE_MM": ("wide", "not a number"),
        "EPID_INTERLEAF_LEAKAGE_PERCENT": ("inf", "a number in 0..20"),
        "EPID_LAG_PERCENT": ("50", "a number in 0..20"),
        "EPID_BACKSCATTER_PERCENT": ("31", "a number in 0..30"),
        "EPID_NOISE_SEED": ("seed", "not an integer"),
        "EPID_CACHE_DIR": (str(a_file), "exists and is not a directory"),
        "EPID_NUM_WORKERS": ("two", "not an integer"),
        "EPID_PIN_MEMORY": ("pinned", "1/0, true/false or yes/no"),
        "EPID_PREFETCH_FACTOR": ("0", "an integer >= 1"),
        "EPID_BATCH_ORDER": ("random", "sequential or shuffled"),
        "EPID_MODEL": ("bigger", "legacy"),
        "EPID_MODEL_SIZE": ("huge", "full, small or tiny"),
        "EPID_VAL_STEPS": ("-1", "an integer >= 0"),
        "EPID_GRAD_CLIP": ("-1", "a number >= 0"),
        "EPID_TIME_LIMIT": ("one hour", "not a number"),
        "EPID_LOG_SECONDS": ("0", "a number > 0"),
        "EPID_TENSORBOARD": (str(a_file), "exists and is not a directory"),
        "EPID_COLLECTIVE_TIMEOUT": ("0", "an integer >= 1"),
        "EPID_EPOCHS": ("0", "an integer >= 1"),
        "EPID_STEPS_PER_EPOCH": ("-2", "an integer >= 0"),
        "EPID_LR": ("0", "a number > 0"),
        "EPID_WEIGHT_DECAY": ("inf", "a number >= 0"),
        "EPID_LR_SCALING": ("cubic", "none, linear or sqrt"),
        "EPID_WARMUP_EPOCHS": ("x", "not an integer"),
        "EPID_WARMUP_STEPS": ("-5", "an integer >= 0"),
        "EPID_LR_SCHEDULE": ("step", "cosine-restarts, cosine or linear"),
        "EPID_LR_UPDATE": ("batch", "epoch or step"),
        "EPID_LR_MIN": ("nan", "a number >= 0"),
        "EPID_LR_RESTART_EPOCHS": ("0", "an integer >= 1"),
        "EPID_LR_RESTART_FACTOR": ("1.5", "not an integer"),
        "EPID_GRAD_ACCUM": ("0", "an integer >= 1"),
        "EPID_PRECISION": ("fp8", "auto, bf16, fp16 or fp32"),
        "EPID_COMPILE": ("y", "1/0, true/false or yes/no"),
        "EPID_SEED": ("-3", "an integer >= 0"),
        "EPID_MAX_NONFINITE_STEPS": ("0", "an integer >= 1"),
        "EPID_EARLY_STOP_PATIENCE": ("soon", "not an integer"),
        "EPID_GAMMA_SAMPLES": ("-1", "an integer >= 0"),
        "EPID_CHECKPOINT_PATH": (str(tmp_path), "is a directory"),
        "EPID_RESUME": ("please", "1/0, true/false or yes/no"),
        "EPID_PROGRESS": ("loud", "1/0, true/false or yes/no"),
        "EPID_TIMING_EVERY": ("often", "not an integer"),
        "EPID_TIMING_MAX": ("-1", "an integer >= 0"),
    }


def test_every_variable_has_a_bad_value_case(tmp_path):
    assert set(bad_values(tmp_path)) == {variable.name for variable in VARIABLES}


@pytest.mark.parametrize("name", [variable.name for variable in VARIABLES])
def test_every_bad_value_is_rejected_by_name(name, tmp_path):
    value, fragment = bad_values(tmp_path)[name]
    with pytest.raises(ConfigError) as caught:
        load_config({name: value})
    message = str(caught.value)
    assert message.startswith(f"{name}={value!r}: ")
    assert fragment in message
    assert "\n" not in message
    assert isinstance(caught.value, InputError)


def test_combinations_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="^EPID_DATASET_IDS='1': EPID_DATASET_RANGE is also set"):
        load_config({"EPID_DATASET_RANGE": "0:4", "EPID_DATASET_IDS": "1"})
    with pytest.raises(ConfigError, match="rank 2 would get no dataset"):
        load_config({"EPID_WORLD_SIZE": "3", "EPID_DATASET_IDS": "1,2"})
    with pytest.raises(ConfigError, match="^EPID_WORLD_SIZE='200': the default per-rank batch"):
        load_config({**LEGACY, "EPID_WORLD_SIZE": "200", "EPID_BATCH_SIZE": ""})
    with pytest.raises(ConfigError, match="^EPID_WARMUP_STEPS='100': EPID_WARMUP_EPOCHS is also set"):
        load_config({"EPID_WARMUP_STEPS": "100", "EPID_WARMUP_EPOCHS": "1", "EPID_LR_UPDATE": "step"})
    with pytest.raises(ConfigError, match="^EPID_WARMUP_STEPS='100': the learning rate moves once per epoch"):
        load_config({**LEGACY, "EPID_WARMUP_STEPS": "100"})
    with pytest.raises(ConfigError, match="^EPID_RESUME='1': no checkpoint at EPID_CHECKPOINT_PATH"):
        load_config({"EPID_RESUME": "1", "EPID_CHECKPOINT_PATH": str(tmp_path / "none.pth")})


def test_a_model_size_the_family_lacks_is_named(monkeypatch):
    legacy = families.FAMILIES[families.LEGACY]
    only_full = dataclasses.replace(legacy, sizes={"full": legacy.sizes["full"]})
    monkeypatch.setitem(families.FAMILIES, families.LEGACY, only_full)
    with pytest.raises(ConfigError, match=r"^EPID_MODEL_SIZE='tiny': the legacy family has no such size; expected one "
                                          r"of full$"):
        load_config({**LEGACY, "EPID_MODEL_SIZE": "tiny"})


def test_the_model_families_are_the_registered_ones():
    assert VARIABLE_OF_FIELD["model"].parse.words == tuple(families.FAMILIES)
    assert load_config({}).model == families.DEFAULT_FAMILY


@pytest.mark.parametrize("name, suggestion", [("EPID_BATCHSIZE", "did you mean EPID_BATCH_SIZE or EPID_BATCH_ORDER?"),
                                              ("EPID_EPOCH", "did you mean EPID_EPOCHS?"),
                                              ("EPID_TENSORBORD", "did you mean EPID_TENSORBOARD?"),
                                              ("EPID_QWERTY", "not a known variable (expected")])
def test_an_unknown_epid_name_is_rejected_with_the_closest_known_names(name, suggestion):
    with pytest.raises(ConfigError) as caught:
        load_config({name: "64", "EPID_EPOCHS": "3"})
    message = str(caught.value)
    assert message.startswith(f"{name}='64': not a known variable") and suggestion in message
    assert "\n" not in message
    assert load_config({"EPID_TEST_INDUCTOR": "1"}) == load_config({})  # the test suite's own switch


def run_script(env_update, *args):
    return subprocess.run(
        [sys.executable, str(ROOT / "generate_and_train.py"), *args],
        env=clean_environment(**env_update), capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )


def test_physics_comes_from_the_preset_and_each_variable_overrides_it():
    assert Config().physics.is_ideal and load_config({}).physics.is_ideal
    assert load_config({"EPID_PHYSICS": "Realistic"}).physics == PRESETS["realistic"]
    config = load_config({"EPID_PHYSICS": "realistic", "EPID_LAG_PERCENT": "0", "EPID_LEAF_END_OFFSET_MM": "1.1"})
    assert config.physics == dataclasses.replace(PRESETS["realistic"], lag_percent=0.0, leaf_end_offset_mm=1.1)
    assert load_config({"EPID_TONGUE_GROOVE_MM": "0.5"}).physics == Physics(tongue_groove_mm=0.5)
    assert Config.from_dict(config.to_dict()).physics == config.physics


def test_a_bad_physics_value_stops_the_run_with_exit_2():
    result = run_script({"EPID_LAG_PERCENT": "50"})
    assert result.returncode == 2
    assert result.stderr.strip() == "generate_and_train.py: error: EPID_LAG_PERCENT='50': expected a number in 0..20"


def test_entry_script_reports_bad_value_in_one_line_and_exits_2():
    result = run_script({"EPID_DATASET_RANGE": "0:640:0"})
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "generate_and_train.py: error: EPID_DATASET_RANGE='0:640:0': step cannot be 0; "
        "expected start:stop[:step] with IDs in 0..639"
    )
    assert "Traceback" not in result.stderr


def test_a_misspelt_variable_stops_the_run_before_anything_starts(tmp_path):
    checkpoint = tmp_path / "run" / "epid.pth"
    result = run_script({"EPID_BATCHSIZE": "64", "EPID_CHECKPOINT_PATH": str(checkpoint)})
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "generate_and_train.py: error: EPID_BATCHSIZE='64': not a known variable; did you mean EPID_BATCH_SIZE or "
        "EPID_BATCH_ORDER? (expected one of the EPID_* variables that generate_and_train.py --help lists)"
    )
    assert result.stdout == "" and not checkpoint.parent.exists()


def test_dry_run_prints_config_and_rank_ids():
    result = run_script({"EPID_DRY_RUN": "1", "EPID_WORLD_SIZE": "3", "EPID_DATASET_RANGE": "0:640:80"})
    assert result.returncode == 0, result.stderr
    assert "EPID_WORLD_SIZE" in result.stdout
    assert re.search(r"^  EPID_BATCH_SIZE += 8$", result.stdout, re.MULTILINE)  # the aperture recipe's
    rank_lines = re.findall(r"rank (\d): (\d) dataset\(s\): ([\d, ]+)", result.stdout)
    assert [int(rank) for rank, _, _ in rank_lines] == [0, 1, 2]
    seen = sorted(int(i) for _, _, ids in rank_lines for i in ids.split(", "))
    assert seen == list(range(0, 640, 80))


def test_help_lists_every_variable_with_its_default():
    result = run_script({}, "--help")
    assert result.returncode == 0
    assert help_text() in result.stdout
    for variable in VARIABLES:
        shown = variable.shown_default + recipe_defaults(variable)
        line = rf"^  {variable.name}\s+default {re.escape(shown)}$"
        assert re.search(line, result.stdout, re.MULTILINE)


def readme_table_rows() -> list[str]:
    """The rows of the README's variable table, header and rule included."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("| Variable | Meaning | Default | Example |")
    stop = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start:stop]


def test_readme_table_is_the_variable_table_row_for_row():
    assert readme_table_rows() == markdown_table().splitlines()
    rows = readme_table_rows()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{variable.name}`" for variable in VARIABLES]


@pytest.mark.parametrize("value, fragment", [
    ("millenium", "no built-in MLC of that name and no such file; expected one of legacy, agility"),
    ("{file}", "not a DICOM file"),
])
def test_an_unknown_mlc_or_a_file_that_is_no_plan_is_refused(tmp_path, value, fragment):
    a_file = tmp_path / "plan.dcm"
    a_file.write_text("not a plan")
    with pytest.raises(ConfigError) as caught:
        load_config({"EPID_MLC": value.format(file=a_file)})
    assert str(caught.value).startswith("EPID_MLC=") and fragment in str(caught.value)


def test_hd120_takes_the_aperture_family_and_the_legacy_family_is_refused_in_one_line():
    hd120 = load_config({"EPID_MLC": "hd120"})
    assert hd120.mlc_geometry is MLC_GEOMETRIES["hd120"] and hd120.mlc_geometry.grid.count == 104
    with pytest.raises(ConfigError) as caught:
        load_config({"EPID_MLC": "hd120", "EPID_MODEL": "legacy"})
    message = str(caught.value)
    assert message.startswith("EPID_MLC='hd120': Varian HD120") and "\n" not in message
    assert "the legacy model family works on the design's 52 strips of 5 mm" in message
    assert "expected EPID_MODEL=aperture" in message


def test_the_mlc_is_a_built_in_one_by_name_or_a_plans_own_and_survives_a_round_trip(tmp_path):
    from tests.dicom.test_plan_and_image import hand_plan, random_leaves, saved

    assert load_config({}).mlc_geometry.name == "legacy"
    halcyon = load_config({"EPID_MLC": "halcyon"})
    assert halcyon.mlc_geometry == MLC_GEOMETRIES["halcyon"]
    assert Config.from_dict(halcyon.to_dict()).mlc_geometry is MLC_GEOMETRIES["halcyon"]
    boundaries = np.linspace(-150, 150, 31)  # 30 pairs of 10 mm: no built-in MLC
    path = saved(tmp_path, hand_plan(boundaries, *random_leaves(np.random.default_rng(0), 2, 30)))
    own = load_config({"EPID_MLC": str(path)}).mlc_geometry
    assert own.name == "plan" and own.layers == (tuple(boundaries),) and own.pairs == (30,)
    assert Config.from_dict(load_config({"EPID_MLC": str(path)}).to_dict()).mlc_geometry == own


def test_plans_of_two_mlcs_or_plans_against_epid_mlc_are_refused(tmp_path):
    from tests.dicom.test_plan_and_image import hand_plan, random_leaves, saved

    rng = np.random.default_rng(2)
    folder = tmp_path / "plans"
    folder.mkdir()
    saved(folder, hand_plan(np.linspace(-200, 200, 81), *random_leaves(rng, 4, 80)), "a_agility.dcm")
    assert load_config({"EPID_PLANS": str(folder)}).mlc_geometry is MLC_GEOMETRIES["agility"]
    with pytest.raises(ConfigError) as caught:
        load_config({"EPID_PLANS": str(folder), "EPID_MLC": "halcyon"})
    assert str(caught.value).startswith("EPID_MLC='halcyon': EPID_PLANS's plans are on agility")
    saved(folder, hand_plan(np.linspace(-200, 200, 41), *random_leaves(rng, 4, 40)), "b_mlci2.dcm")
    with pytest.raises(ConfigError) as caught:
        load_config({"EPID_PLANS": str(folder)})
    message = str(caught.value)
    assert "b_mlci2.dcm: beam 1 (VMAT): MLC MLCX (mlci2)" in message and "share one MLC" in message
