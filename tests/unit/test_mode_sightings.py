"""Which process image the unwinding modes look at (pipeline.profiler's
ConsideredImages): the newest of each process, again when its maps were
re-read, and after an exec or a reused pid with what they installed for
the image before forgotten."""

from __future__ import annotations

from tramprof.pipeline.profiler import ConsideredImages, Sighting

PID = 4321


def test_maps_re_read_are_looked_at_again_and_only_then() -> None:
    images = ConsideredImages()
    assert images.sighting((PID, 100, 0), 1) is Sighting.LOOK
    assert images.sighting((PID, 100, 0), 1) is Sighting.SEEN
    assert images.sighting((PID, 100, 0), 2) is Sighting.LOOK
    assert images.sighting((PID, 100, 0), 2) is Sighting.SEEN


def test_an_exec_whose_first_maps_have_the_old_generation_is_looked_at() -> None:
    """Each image counts its maps reads from 1: the new image's first read
    looks like the old image's last one, and must not be taken for it."""
    images = ConsideredImages()
    assert images.sighting((PID, 100, 0), 1) is Sighting.LOOK
    assert images.sighting((PID, 100, 1), 1) is Sighting.REPLACED
    assert images.sighting((PID, 100, 1), 1) is Sighting.SEEN


def test_the_image_before_an_exec_is_not_shown_again() -> None:
    """Samples from before the exec, named with the old image in a later
    drain, leave the modes on the new image."""
    images = ConsideredImages()
    assert images.sighting((PID, 100, 1), 1) is Sighting.LOOK
    assert images.sighting((PID, 100, 0), 3) is Sighting.SEEN
    assert images.sighting((PID, 100, 1), 1) is Sighting.SEEN


def test_a_reused_pid_replaces_the_exited_process() -> None:
    images = ConsideredImages()
    assert images.sighting((PID, 100, 2), 5) is Sighting.LOOK
    assert images.sighting((PID, 900, 0), 1) is Sighting.REPLACED
    assert images.sighting((PID + 1, 100, 0), 1) is Sighting.LOOK


def test_exited_processes_are_forgotten() -> None:
    images = ConsideredImages()
    images.sighting((PID, 100, 0), 1)
    images.sighting((PID + 1, 100, 0), 1)
    images.forget_exited({PID + 1})
    assert images.sighting((PID, 100, 0), 1) is Sighting.LOOK
    assert images.sighting((PID + 1, 100, 0), 1) is Sighting.SEEN


def test_a_process_the_modes_dropped_is_shown_again() -> None:
    """A process that failed and backed off: its image, sampled again with
    the same maps, is looked at afresh."""
    images = ConsideredImages()
    assert images.sighting((PID, 100, 0), 1) is Sighting.LOOK
    images.forget(PID)
    assert images.sighting((PID, 100, 0), 1) is Sighting.LOOK
