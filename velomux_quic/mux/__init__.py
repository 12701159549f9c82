"""The messenger mux: many streams to one peer carried as batches of records.

Streams to a peer share one ordered active-message handler per lane instead of owning a
connection each, so sockets and batchers scale with peers, not streams. The cores are
sans-IO, tested and fuzzed with bytes and explicit clocks alone: the wire codec
(:mod:`.protocol`, the framing of batches, with :mod:`.records`, what each record means),
the sending side (:mod:`.egress` with :mod:`.packing` and :mod:`.slots`), the receiving
side (:mod:`.ingress` with :mod:`.arrival`, :mod:`.credit`, :mod:`.binds`) and the lane
rules (:mod:`.lanes`, :mod:`.placement`). :mod:`.driver` and :mod:`.transport` put them
on the event loop and the messenger; :mod:`.singleton` and :mod:`.health` cover records
too large for a batch and peers that stop answering.
"""
