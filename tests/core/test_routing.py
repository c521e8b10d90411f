import zlib

from kvcache_exporter.routing import route, route_all


def test_session_routing_is_crc32_of_the_session_and_round_robin_counts_only_what_it_routes():
    sessions = ["a", None, "b", None, "", None]
    got = route_all(sessions, 3, "session")
    assert got[0] == zlib.crc32(b"a") % 3 and got[2] == zlib.crc32(b"b") % 3
    assert [got[i] for i in (1, 3, 4, 5)] == [0, 1, 2, 0]  # "" has no session: round-robin
    assert route_all(sessions, 3, "round_robin") == [0, 1, 2, 0, 1, 2]
    assert route("session", 4, "a", 99) == zlib.crc32(b"a") % 4
