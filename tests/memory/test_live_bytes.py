"""Eager's live bytes, measured op by op: on a step small enough to count by hand, the forward
leaves what autograd saved and the backward ends with the gradient alone."""

import torch

from seqcompile.memory.live_bytes import measure_step


def test_a_step_counted_by_hand():
    w = torch.nn.Parameter(torch.randn(1000))  # 4000 bytes, there before the step

    def forward():
        y = w * 2  # 4000 bytes, saved by y * y
        return (y * y).sum()  # y * y (4000 bytes) is freed once summed; the loss is 4 bytes

    timeline = measure_step(forward, [w])
    # after each op, then once the forward has returned
    assert timeline.values[: timeline.forward_steps] == (4000, 8000, 8004, 4004)
    assert timeline.after_forward == 4004
    # the backward's own values come and go; w.grad (4000 bytes) is what stays
    assert timeline.peak >= 8004
    assert timeline.after_backward == 4000
    assert w.grad is not None


def test_tensors_that_exist_before_the_step_are_left_out():
    x = torch.randn(256, requires_grad=True)
    view_of_x = x[:128]
    timeline = measure_step(lambda: (view_of_x * 1).sum(), [x])
    # a view of x shares its storage: only the product and the loss are counted
    assert timeline.values[0] == 512
