"""lab.step_addresses on the CPU: donated state keeps its buffers from step to step, a batch cycled
through two buffers moves every step, one batch buffer never does; XLA's update lines are parsed."""

from lab import step_addresses

SMALL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
         "model.vocab_size=64", "attention.impl=jnp"]


def _rows(tmp_path, *extra):
    out = tmp_path / "a.json"
    args = ["--preset", "tiny-cpu", "--batch", "2", "--steps", "3", "--out", str(out), *extra]
    for s in SMALL:
        args += ["--set", s]
    return step_addresses.main(args)["rows"]


def test_donated_state_stays_and_batches_move_as_cycled(tmp_path):
    two = _rows(tmp_path, "--batches", "2", "--keep-metrics")
    assert all(r["state_moved"] == 0 and r["state_arrays"] > 10 for r in two)
    assert [r["batch_moved"] for r in two] == [None, 2, 2]  # (x, y) of the other buffer
    assert [r["metrics_moved"] for r in two][1:] == [3, 3]  # kept alive: new buffers each step
    one = _rows(tmp_path, "--batches", "1")
    assert [r["batch_moved"] for r in one] == [None, 0, 0]


def test_update_lines_are_parsed():
    log = ("I0101 command_buffer_thunk.cc:220] Update command buffer on device #0 by recoding "
           "command buffer cmd sequence after 1 executions since last update; num_commands=686; "
           "updated_allocs=3\nunrelated\nI0101 command_buffer_thunk.cc:220] Update command buffer "
           "on device #0 by recoding ...; num_commands=686; updated_allocs=1\n")
    assert step_addresses.updates_in(log) == [3, 1]
    assert len(step_addresses.command_buffer_lines(log)) == 2
