# cython: language_level=3
"""The compiled twin of the mux's channel (selected by velomux_quic.recordpath).

:class:`MuxChannel` twins the pure-Python definition in ``driver.py``, which stays the
reference: the rules are the pure code's, line for line, with the same errors, bounds and
counters; only the representation differs (the channel's fields are C fields, and its
``try_send`` calls the batcher's ``offer`` in C).

The state it works on is written once, in compiled modules: the egress batcher
(``egress.py``) and the egress slot (``slots.py``). Their C declarations are cimported from
their ``.pxd`` files, and those modules are imported with this one. The driver module is
imported when first needed, not at import: this module is loaded while the pure modules
that select it are still being defined.
"""

from velomux_quic.mux.egress cimport EgressBatcher
from velomux_quic.mux.slots cimport EgressSlot
from velomux_quic.streaming.channels cimport StagingChannel

# Bound on first use (see the module docstring); the slot states at import (_bind_slots).
cdef object _OPENING = None
cdef object _OPEN = None
cdef object _CLOSED = None
cdef object _driver = None

cdef int _bind_slots() except -1:
    global _OPENING, _OPEN, _CLOSED
    from velomux_quic.mux import slots

    state = slots.SlotState
    _OPENING = state.OPENING
    _OPEN = state.OPEN
    _CLOSED = state.CLOSED
    return 0


# The slots module is imported already: its EgressSlot is cimported above.
_bind_slots()


cdef object driver_module():
    global _driver
    if _driver is None:
        from velomux_quic.mux import driver as module
        _driver = module
    return _driver


# -- driver.py --------------------------------------------------------------------------


cdef class MuxChannel(StagingChannel):
    """Twin of :class:`velomux_quic.mux.driver.MuxChannel`: ``try_send`` stages a record
    without leaving C (the compiled batcher's ``offer`` is called directly), and the
    streaming layer's loops call it as a :class:`StagingChannel`, without a method lookup."""

    cdef object _driver
    cdef EgressSlot _slot
    cdef object _batcher
    cdef EgressBatcher _egress
    cdef object _clock

    def __init__(self, driver, slot):
        self._driver = driver
        self._slot = slot
        self._batcher = driver.batcher
        self._clock = driver._loop.time
        # Called in C when it is the compiled batcher (final: no subclass overrides offer).
        if type(self._batcher) is EgressBatcher:
            self._egress = <EgressBatcher>self._batcher

    @property
    def slot(self):
        return self._slot

    @property
    def session_id(self):
        return self._slot.session_id

    @property
    def credit(self):
        slot = self._slot
        return slot.credit if slot.state is not _CLOSED else 0

    @property
    def queued_bytes(self):
        return self._slot.queued_bytes

    @property
    def lane(self):
        return self._driver.batcher.lane

    def watch(self, owner):
        self._slot.owner = owner

    @property
    def closed(self):
        return self._slot.state > _OPEN

    cpdef bint try_send(self, object body) except -1:
        return self.stage(body) == 1

    cdef int stage(self, object body) except -1:
        slot = self._slot
        state = slot.state
        if state is not _OPEN and state is not _OPENING:
            return 0
        if self._egress is not None:
            if not self._egress.offer(slot, body, self._clock):
                return 0
        elif not self._batcher.offer(slot, body, self._clock):
            return 0
        driver = self._driver
        if driver._wake is None:
            driver.wake()
        return 1

    async def send(self, body):
        driver = self._driver
        while True:
            if self.closed:
                raise driver_module().ChannelClosed("the mux slot is closed")
            if driver.batcher.offer(self._slot, body, driver.now()):
                driver.wake()
                return
            await driver.wait_space(self._slot)

    def send_terminal(self, body, done):
        if self.closed:
            done.set_result(False)
            return
        driver = self._driver
        driver.batcher.offer_terminal(
            self._slot, body, driver.now(), guard=driver_module().DeliveryGuard(done)
        )
        driver.wake()

    def end_now(self, body, done):
        if self.closed:
            done.set_result(False)
            return
        driver = self._driver
        driver.batcher.end_now(
            self._slot, body, driver.now(), guard=driver_module().DeliveryGuard(done)
        )
        driver.wake()

    def abort(self):
        if self._slot.state <= _OPEN:
            self._driver.batcher.cancel_slot(self._slot)
            self._driver.wake()
