"""AioConfig: DeepSpeed's ``aio`` section, key for key, with errors that name the key."""

from __future__ import annotations

import pytest
from ds_config import ConfigError

from ds_io import AioConfig

# The "aio" section of shared/configs/zero3_nvme.json, verbatim.
ZERO3_NVME_AIO = {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                  "overlap_events": True}
# DeepSpeed's config reference example and ds_nvme_tune's printed recommendation (strings for bools).
REFERENCE_AIO = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                 "overlap_events": True}
TUNE_OUTPUT_AIO = {"single_submit": "false", "overlap_events": "true", "intra_op_parallelism": 8,
                   "queue_depth": 32, "block_size": 1048576}


def test_zero3_nvme_section_loads():
    c = AioConfig(**ZERO3_NVME_AIO)
    assert (c.block_size, c.queue_depth, c.intra_op_parallelism, c.single_submit, c.overlap_events, c.use_gds) == (
        262144, 32, 1, False, True, False)
    assert c.handle_kwargs() == {"block_size": 262144, "queue_depth": 32, "single_submit": False,
                                 "overlap_events": True, "intra_op_parallelism": 1, "buffered_reads": False}


def test_defaults_are_deepspeeds():
    assert AioConfig() == AioConfig(**REFERENCE_AIO)


def test_tune_output_with_string_booleans_loads():
    c = AioConfig(**TUNE_OUTPUT_AIO)
    assert c.intra_op_parallelism == 8 and c.single_submit is False and c.overlap_events is True


def test_thread_count_is_intra_op_parallelism_and_roundtrips():
    assert AioConfig(thread_count=4).intra_op_parallelism == 4
    assert AioConfig(intra_op_parallelism=4) == AioConfig(thread_count=4)
    again = AioConfig(**AioConfig(thread_count=3, block_size=1e6).to_ds_config()["aio"])
    assert again.intra_op_parallelism == 3 and again.block_size == 1_000_000


@pytest.mark.parametrize("section, message", [
    ({"blok_size": 4096}, "aio.blok_size: unknown key 'blok_size'; did you mean 'block_size'?"),
    ({"thread_cnt": 2}, "did you mean 'thread_count'?"),
    ({"block_size": 0}, "aio.block_size: must be greater than or equal to 512, got 0"),
    ({"block_size": 2**40}, "aio.block_size: must be less than or equal to 268435456, got 1099511627776"),
    ({"queue_depth": 10**12}, "aio.queue_depth: must be less than or equal to 65536, got 1000000000000"),
    ({"thread_count": 100000}, "aio.thread_count: must be less than or equal to 256, got 100000"),
    ({"intra_op_parallelism": 0}, "aio.intra_op_parallelism: must be greater than or equal to 1, got 0"),
    ({"queue_depth": 2.5}, "aio.queue_depth: must be an integer, got 2.5"),
    ({"queue_depth": True}, "aio.queue_depth: must be an integer, got True"),
    ({"queue_depth": "8"}, "aio.queue_depth: must be an integer, got '8'"),
    ({"overlap_events": "maybe"}, "aio.overlap_events: must be true or false, got 'maybe'"),
    ({"single_submit": 2}, "aio.single_submit: must be true or false, got 2"),  # 0 and 1 are booleans, as in DeepSpeed
    ({"thread_count": 2, "intra_op_parallelism": 2}, "give 'thread_count' or 'intra_op_parallelism', not both"),
])
def test_bad_sections_name_the_key_and_what_is_allowed(section, message):
    with pytest.raises(ConfigError) as info:
        AioConfig.model_validate(section)
    assert message in str(info.value)


def test_bounds_are_the_handles():
    from ds_io._limits import RANGES

    for name, (low, high) in RANGES.items():
        assert getattr(AioConfig(**{name: low}), name) == low and getattr(AioConfig(**{name: high}), name) == high
        for bad in (low - 1, high + 1):
            with pytest.raises(ConfigError, match=f"aio.{name}: must be"):
                AioConfig(**{name: bad})


def test_buffered_reads_reaches_the_handle():
    assert AioConfig().handle_kwargs()["buffered_reads"] is False
    assert AioConfig(buffered_reads=True).handle_kwargs()["buffered_reads"] is True
    assert AioConfig(**AioConfig(buffered_reads=True).to_ds_config()["aio"]).buffered_reads is True
