"""Operator views: what runs on a queue, read from Redis alone (heartbeat records, streams, stats), so that one
view shows every worker on every host. `pagedq status`, `pagedq workers`, the dashboard (`pagedq dashboard`, and
`/dashboard` of `pagedq serve`) and the hint that finds a job in another queue. Imports `producer` only.
"""
