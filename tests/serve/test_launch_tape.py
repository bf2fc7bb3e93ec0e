"""export/ops/launch_tape.py's bookkeeping on CPU, without a kernel run: which launches a tape can
keep (their tensors are the layer's roles or the step's), where a replay puts another layer's
tensors, and when it refuses (other strides).  The launches themselves are replayed bit-exactly in
tests/serve/test_vllm_mixer.py."""
import pytest

from conftest import need

torch = need("torch")

from export.ops import launch_keys, launch_tape  # noqa: E402


def _tape():
    roles = {"x": torch.zeros(4, 8), "w": torch.ones(8, 8)}
    return launch_tape.Tape(roles, direct_ok=False), roles


def test_kept_launch_records_role_positions_and_step_tensors():
    tape, roles = _tape()
    buf = torch.empty(4, 8)
    tape.step(buf)
    tape.launched(launch_keys.Launch("kernel", (2,), (roles["x"], 7, buf, roles["w"]), {"BLOCK": 16}), None)
    assert tape.valid and len(tape.entries) == 1
    assert tape.entries[0].subs == [(0, "x"), (3, "w")]


@pytest.mark.parametrize("why", ["foreign tensor", "tensor by keyword"])
def test_a_launch_with_an_unknown_tensor_leaves_the_tape_unused(why):
    tape, roles = _tape()
    other = torch.empty(4, 8)          # say a launcher's contiguous copy of the layer's input
    if why == "foreign tensor":
        launch = launch_keys.Launch("kernel", (1,), (roles["x"], other), {})
    else:                              # a role passed by keyword has no position to fill
        launch = launch_keys.Launch("kernel", (1,), (7,), {"x_ptr": roles["x"]})
    tape.launched(launch, None)
    assert not tape.valid


def test_replay_runs_the_recorded_gemms_with_the_other_layers_tensors_or_refuses():
    g = torch.Generator().manual_seed(0)
    roles0 = {"x": torch.randn(5, 6, generator=g), "w": torch.randn(3, 6, generator=g),
              "res": torch.randn(5, 3, generator=g), "w_out": torch.randn(3, 3, generator=g)}
    tape = launch_tape.Tape(roles0, direct_ok=False)
    tape.step(roles0["x"])
    y = tape.mm(roles0["x"], "w")
    tape.addmm_("res", y, "w_out")
    assert tape.valid
    # another layer: its own weights and residual; the step's input is the same tensor
    roles1 = {"x": roles0["x"], "w": torch.randn(3, 6, generator=g), "res": torch.randn(5, 3, generator=g),
              "w_out": torch.randn(3, 3, generator=g)}
    # the ops the mixer runs, on layer 1's tensors: the replay must give these very bits
    want = roles1["res"].clone().addmm_(torch.mm(roles1["x"], roles1["w"].t()), roles1["w_out"].t())
    assert tape.replay(roles1)
    assert torch.equal(roles1["res"], want)
    # a residual with other strides: nothing runs
    wide = torch.zeros(5, 6)
    strided = dict(roles1, res=wide[:, :3])
    assert not tape.replay(strided)
    assert torch.equal(wide, torch.zeros(5, 6))
