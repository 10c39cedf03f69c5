"""Launch configurations tuned on first use and cached on disk: the fastest candidate runs and is
remembered per device and Triton version; a file entry outside the declared space, a damaged file
or a candidate the device cannot run never decides; where tuning does not apply the default runs.

No GPU here: the device check is forced and Triton's timer replaced by declared times."""

import json

import pytest
import torch
from triton.runtime.errors import OutOfResources

from seqcompile.codegen import KernelSpec, tuning
from seqcompile.codegen.tuning import Config
from seqcompile.ops.add_norm import kernels as norm
from seqcompile.ops.attention import configs as attention_configs

SPEC = KernelSpec.of("attention_fwd", causal=True)
SPACE = [Config.of(BLOCK_M=m, num_warps=w) for m, w in ((128, 4), (64, 4), (128, 8))]
CUDA = torch.device("cuda")


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """Tuning forced on, the file under `tmp_path`, and `do_bench` answering from `times` (by
    BLOCK_M and warps) while counting what it timed."""
    monkeypatch.setattr(tuning, "autotuning", lambda device: device.type == "cuda")
    monkeypatch.setattr(tuning, "tuning_file", lambda device: tmp_path / "tuning" / "gpu.json")
    monkeypatch.setattr(tuning, "_MEMORY", {})
    state = {"times": {}, "timed": [], "raises": set()}

    def do_bench(fn, **_):
        fn()
        config = state["current"]
        state["timed"].append(config)
        if config in state["raises"]:
            raise OutOfResources(300000, 232448, "shared memory")
        return state["times"][config]

    monkeypatch.setattr("triton.testing.do_bench", do_bench)
    return state


def launch(state, key=("bf16", 128), repeatable=True, space=SPACE):
    ran = []

    def run(config):
        state["current"] = config
        ran.append(config)

    chosen = tuning.launch(SPEC, key, space, run, CUDA, repeatable=repeatable)
    assert ran[-1] == chosen  # the launch itself runs at the chosen configuration
    return chosen


def test_the_fastest_candidate_is_chosen_once_and_read_back_from_disk(timed, tmp_path):
    timed["times"] = {SPACE[0]: 2.0, SPACE[1]: 1.0, SPACE[2]: 3.0}
    assert launch(timed) == SPACE[1]
    assert timed["timed"] == SPACE
    assert launch(timed) == SPACE[1] and len(timed["timed"]) == 3  # remembered in memory
    tuning._MEMORY.clear()  # a new process: read from the file, nothing timed again
    assert launch(timed) == SPACE[1] and len(timed["timed"]) == 3
    (entry,) = json.loads((tmp_path / "tuning" / "gpu.json").read_text()).values()
    assert entry == {"blocks": {"BLOCK_M": 64}, "warps": 4, "stages": None}
    assert launch(timed, key=("bf16", 64)) == SPACE[1] and len(timed["timed"]) == 6  # a new key


def test_a_remembered_launch_names_hashes_and_reads_nothing(timed, monkeypatch, tmp_path):
    """The host cost of every launch after the first: a dictionary lookup, no file name (on CUDA
    the device's name and the cache folder's creation), no hash of the kernel's key, no read."""
    timed["times"] = {SPACE[0]: 2.0, SPACE[1]: 1.0, SPACE[2]: 3.0}
    launch(timed)

    def refuse(*args, **kwargs):
        raise AssertionError("a remembered launch looked beyond its memory")

    for name in ("tuning_file", "text_digest", "read_entries"):
        monkeypatch.setattr(tuning, name, refuse)
    assert launch(timed) == SPACE[1]
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(tmp_path / "elsewhere"))  # another folder: anew
    with pytest.raises(AssertionError, match="looked beyond its memory"):
        launch(timed)


@pytest.mark.parametrize(
    "text", ['{"x": 1', "[]", None], ids=["truncated", "not_a_table", "outside_the_space"]
)
def test_a_file_that_names_no_declared_candidate_is_tuned_again(timed, tmp_path, text):
    timed["times"] = {SPACE[0]: 2.0, SPACE[1]: 3.0, SPACE[2]: 1.0}
    assert launch(timed) == SPACE[2]
    path = tmp_path / "tuning" / "gpu.json"
    if text is None:  # an entry for a configuration the code does not declare
        (name,) = json.loads(path.read_text())
        text = json.dumps({name: {"blocks": {"BLOCK_M": 256}, "warps": 16, "stages": 9}})
    path.write_text(text)
    tuning._MEMORY.clear()
    timed["times"][SPACE[0]] = 0.5
    assert launch(timed) == SPACE[0]
    assert len(timed["timed"]) == 6
    assert list(json.loads(path.read_text()).values())[-1]["blocks"] == {"BLOCK_M": 128}


def test_a_candidate_the_device_cannot_run_is_left_out_but_never_the_default(timed):
    timed["times"] = {SPACE[0]: 2.0, SPACE[1]: 1.0, SPACE[2]: 3.0}
    timed["raises"] = {SPACE[1]}
    assert launch(timed) == SPACE[0]
    tuning._MEMORY.clear()
    timed["raises"] = {SPACE[0]}
    with pytest.raises(OutOfResources):
        launch(timed, key=("fp16", 128))


def test_where_tuning_does_not_apply_the_default_runs_untimed(timed, monkeypatch):
    timed["times"] = {SPACE[0]: 2.0, SPACE[1]: 1.0, SPACE[2]: 3.0}
    assert launch(timed, repeatable=False) == SPACE[0]  # a launch that adds into its outputs
    assert launch(timed, space=SPACE[:1]) == SPACE[0]
    monkeypatch.setattr(tuning, "autotuning", lambda device: False)  # off, or not CUDA
    assert launch(timed) == SPACE[0]
    assert not timed["timed"]


def test_autotuning_is_on_for_cuda_unless_switched_off(monkeypatch):
    monkeypatch.delenv("SEQFAST_AUTOTUNE", raising=False)  # (the test suite switches it off)
    assert not tuning.autotuning(torch.device("cpu"))
    assert tuning.autotuning(CUDA)
    monkeypatch.setenv("SEQFAST_AUTOTUNE", "0")
    assert not tuning.autotuning(CUDA)


@pytest.mark.parametrize("kernel", attention_configs.KERNELS)
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_attention_spaces_are_small_and_distinct_and_the_interpreter_keeps_one_tile(
    kernel, head_dim, dtype
):
    space = attention_configs.space(kernel, head_dim, dtype, "cuda")
    assert 1 < len(space) <= 4 and len(set(space)) == len(space)
    for config in space:
        assert config["BLOCK_D"] == attention_configs.block_d(head_dim) >= head_dim
        for name in ("BLOCK_M", "BLOCK_N"):
            assert config[name] >= 16 and config[name] & (config[name] - 1) == 0
    (tile,) = attention_configs.space(kernel, head_dim, dtype, "cpu")
    assert (tile["BLOCK_M"], tile["BLOCK_N"]) == (16, 16)


@pytest.mark.parametrize("width", [1, 96, 768, 4096, 16384])
def test_norm_spaces_hold_the_row_whole_and_the_column_sum_spreads(width):
    rows = norm.row_configs(width, "cuda")
    assert all(c["BLOCK_N"] >= width for c in rows) and len(set(rows)) == len(rows)
    assert all(1 <= c.num_warps <= 16 for c in rows)
    columns = norm.column_configs(width, 2, "cuda")
    default = columns[0]["BLOCK_N"]
    assert 32 <= default <= 256 and len(set(columns)) == len(columns)
    assert default == 32 or -(-width // default) * 2 >= 128  # about 128 programs, or narrowest
    assert len(norm.row_configs(width, "cpu")) == len(norm.column_configs(width, 2, "cpu")) == 1
