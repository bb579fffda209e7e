"""The event log round-trips every message and survives a torn tail."""

from imp.log.eventlog import Envelope, EventLog, LogHeader, read_log
from imp.messages import SCHEMA_VERSION, Cancel, SamplingParams, SeqWork, StepPlan, Submit, Tick


def _header():
    return LogHeader(SCHEMA_VERSION, "f" * 64, {"kv": {"num_blocks": 4}}, 1, "test")


def _envs():
    p = SamplingParams(max_tokens=8, temperature=0.5, seed=7)
    msgs = [
        Submit("r1", (1, 2, 3), p, 100),
        Tick(200),
        StepPlan(1, (SeqWork("r1#0", (1, 2, 3), 0, (0,), True, p),)),
        Cancel("r1"),
    ]
    return [Envelope(i + 1, "a", "b", 0, 0, m) for i, m in enumerate(msgs)]


def test_file_roundtrip(tmp_path):
    path = tmp_path / "log.bin"
    log = EventLog(path)
    log.open(_header())
    for e in _envs():
        log.append(e)
    log.close()
    header, envs = read_log(path)
    assert header == _header()
    assert list(envs) == _envs()


def test_torn_last_record_is_ignored(tmp_path):
    path = tmp_path / "log.bin"
    log = EventLog(path)
    log.open(_header())
    for e in _envs():
        log.append(e)
    log.close()
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    _, envs = read_log(path)
    assert list(envs) == _envs()[:-1]


def test_ring_is_bounded_and_dumps(tmp_path):
    log = EventLog(None, ring=3)
    log.open(_header())
    for e in _envs():
        log.append(e)
    assert len(log.ring) == 3 and log.count == 4
    log.dump(tmp_path / "ring.bin")
    _, envs = read_log(tmp_path / "ring.bin")
    assert list(envs) == _envs()[1:]
