"""A scheduler-process plugin for tests: the loop's idle and role poll ticks become 30 s, so any
PD handoff that waits for a tick instead of waking the loop stalls visibly (loaded by
`--plugin`)."""

from runtime.scheduler import process

process.IDLE_POLL_MS = process.ROLE_POLL_MS = 30_000
