"""The messenger mux: many streams to one peer carried as batches of records.

Streams to a peer share one ordered active-message handler per lane instead of
owning a connection each, so sockets and batchers scale with peers, not
streams. This package holds the wire codec (:mod:`.protocol`) and the lane
placement rules (:mod:`.lanes`); both are sans-IO so they can be tested and
fuzzed with bytes alone.
"""
