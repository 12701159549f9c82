"""Streaming records between nodes: frames, attach control messages, anchors and senders."""
