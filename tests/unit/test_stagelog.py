"""StageStream's terminal side, fed the writes the real libraries make (the whole-CLI check is tests/e2e/test_console.py)."""

from __future__ import annotations

import io

from draftline.stagelog import StageStream


def through_stage_stream(*writes: str) -> tuple[str, str]:
    """(terminal, log) after `writes` went through one StageStream."""
    terminal, log = io.StringIO(), io.StringIO()
    stream = StageStream(terminal, log, set())
    for data in writes:
        stream.write(data)
    stream.close_line()
    return terminal.getvalue(), log.getvalue()


def test_a_tqdm_bar_goes_to_the_log_only():
    """transformers 5's `Loading weights` bar, as tqdm writes it (carriage returns, one newline at the end)."""
    writes = ["\rLoading weights:   0%|          | 0/75 [00:00<?, ?it/s]",
              "\rLoading weights: 100%|██████████| 75/75 [00:00<00:00, 10550.12it/s]", "\n",
              "[bench] round 1 target-only (-) c=1: 96.0 tok/s\n"]
    terminal, log = through_stage_stream(*writes)
    assert terminal == "[bench] round 1 target-only (-) c=1: 96.0 tok/s\n"
    assert "Loading weights: 100%" in log


def test_training_progress_from_a_ray_worker_is_shown_once_without_rays_prefix():
    """Ray forwards a worker's line on stdout and on stderr, colouring the prefix on a terminal."""
    progress = "[train] step 50/300 loss 2.931 acc_0 0.612 | val acc_0 0.655 est_accept_len 2.310 | 812 tokens/s"
    terminal, log = through_stage_stream(
        f"(RayTrainWorker pid=4242) {progress}\n",
        f"\x1b[36m(RayTrainWorker pid=4242, ip=127.0.0.1)\x1b[0m {progress}\n",
        "(RayTrainWorker pid=4242) Checkpoint successfully created at: Checkpoint(filesystem=local, path=/x)\n",
        "(RayTrainWorker pid=4243) [extract] worker 1/2 train: wrote 3 shards\n",
    )
    assert terminal == progress + "\n"
    assert log.count(progress) == 2 and "Checkpoint successfully created" in log


def test_ray_serves_info_lines_in_the_driver_go_to_the_log_and_its_warnings_stay():
    """Ray Serve logs from the driver in its own format; draftline's serving warnings use Serve's logger too."""
    started = 'INFO 2026-12-06 14:54:47,094 serve 22551 -- Started Serve in namespace "serve".\n'
    warning = ("WARNING 2026-12-06 14:54:47,116 serve 22551 -- serving the target alone: model draftline-tiny-llama "
               "has no alias 'champion'\n")
    terminal, log = through_stage_stream(started, warning)
    assert terminal == warning and started in log


def test_a_handler_made_during_a_stage_outlives_it_without_a_logging_error(tmp_path, capsys):
    """The demo's serve stage printed two `--- Logging error ---` tracebacks: a logging handler made during an earlier
    stage (Ray Serve's, bound to the sys.stderr of that moment) kept that stage's stream, whose log was closed."""
    import logging

    from draftline.stagelog import stage_log

    logger = logging.getLogger("draftline.test.made-in-a-stage")
    logger.propagate = False
    with stage_log(tmp_path / "first.log", set()):
        handler = logging.StreamHandler()  # bound to sys.stderr now: the first stage's stream
        logger.addHandler(handler)
    try:
        with stage_log(tmp_path / "second.log", set()):
            logger.warning("a warning in the second stage")
        logger.warning("a warning after both")
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert "Logging error" not in err, err
    assert "a warning in the second stage" in err and "a warning after both" in err
