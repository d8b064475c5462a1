"""Progress output: plain lines when stderr is not a terminal, the tqdm bar on one."""

import io

from foldtrain.train.metrics import RunLogger


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _log_steps(logger: RunLogger, steps: range, log_every: int) -> None:
    for step in steps:
        record = {"step": step, "loss": 5.0 - 0.01 * step, "tokens_per_s": 1234.5}
        if step % 4 == 0:
            record["val_loss"] = 5.5
        logger.log(record, advance=log_every)


def test_not_a_terminal_gets_one_plain_line_per_logged_step(tmp_path):
    stream = io.StringIO()
    logger = RunLogger(tmp_path, enabled=True, total_steps=12, start_step=0, progress=True, stream=stream)
    logger.info("model tiny: ...")
    _log_steps(logger, range(2, 13, 2), log_every=2)
    logger.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "model tiny: ..."
    assert lines[1:] == [
        "step 2/12  loss 4.9800  tok/s 1234",
        "step 4/12  loss 4.9600  val_loss 5.5000  tok/s 1234",
        "step 6/12  loss 4.9400  tok/s 1234",
        "step 8/12  loss 4.9200  val_loss 5.5000  tok/s 1234",
        "step 10/12  loss 4.9000  tok/s 1234",
        "step 12/12  loss 4.8800  val_loss 5.5000  tok/s 1234",
    ]
    # metrics.jsonl holds the same steps whatever the display
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6


def test_terminal_gets_the_live_bar(tmp_path):
    stream = _Terminal()
    logger = RunLogger(tmp_path, enabled=True, total_steps=12, start_step=0, progress=True, stream=stream)
    _log_steps(logger, range(1, 13), log_every=1)
    assert logger.bar is not None and logger.bar.n == 12
    logger.close()
    text = stream.getvalue()
    assert "\r" in text and "loss=4.8800" in text
    assert "step 12/12" not in text


def test_no_progress_and_other_ranks_print_nothing_per_step(tmp_path):
    for enabled, progress in ((True, False), (False, True)):
        stream = io.StringIO()
        logger = RunLogger(tmp_path, enabled=enabled, total_steps=4, start_step=0, progress=progress, stream=stream)
        _log_steps(logger, range(1, 5), log_every=1)
        logger.close()
        assert stream.getvalue() == ""
