"""Secrets through the real `e2b` package (`Secret`, SDK >= 2.43): create, get_info by ID and by
name in any case, exists, update (versions, metadata kept or replaced), list page by page,
destroy, and E2B's errors (409 for a taken name, 400 for an invalid one).

Against the suite's server (run.sh's): its state dir (CORDON_HOME, else /var/lib/cordon) holds
the store, `secrets/` (0700, each record 0600), and run.sh names its log in CORDON_SERVE_LOG;
neither an answer nor a log line may hold a secret's value. A second `cordon serve` on the same
state dir (the binary run.sh exports as CORDON_BIN) reads the secrets back, as a restart would."""

import os
import stat
import uuid

import httpx
import pytest
from e2b import Secret, SecretException, SecretNotFoundException

from conftest import API_KEY, API_URL, Serve

STATE = os.environ.get("CORDON_HOME", "/var/lib/cordon")
STORE = os.path.join(STATE, "secrets")
HEADERS = {"X-API-KEY": API_KEY}


def get(path, url=API_URL):
    return httpx.get(url + path, headers=HEADERS, timeout=30)


def value():
    """A value no other text in the test contains."""
    return f"v-{uuid.uuid4().hex}-{uuid.uuid4().hex}"


def name():
    return f"t-{uuid.uuid4().hex[:16]}"


def test_create_get_update_destroy():
    v1, v2 = value(), value()
    n = name()
    made = Secret.create(n.upper(), v1, metadata={"team": "ml"})
    assert made.secret_id.startswith("sec_")
    assert (made.name, made.version, made.metadata) == (n, 1, {"team": "ml"})
    assert made.created_at == made.updated_at and made.created_at.tzinfo is not None
    assert v1 not in repr(made)

    # The raw answer is E2B's `Secret`, exactly its fields, and no value.
    r = get(f"/secrets/{made.secret_id}")
    assert r.status_code == 200
    assert set(r.json()) == {"secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"}
    assert v1 not in r.text

    for key in (made.secret_id, n, n.upper(), n[:5].upper() + n[5:]):
        info = Secret.get_info(key)
        assert (info.secret_id, info.name, info.version) == (made.secret_id, n, 1), key
    assert Secret.exists(n.upper()) is True
    assert Secret.exists(made.secret_id) is True
    assert Secret.exists(name()) is False
    with pytest.raises(SecretNotFoundException):
        Secret.get_info(name())

    # An update without metadata keeps it; one with metadata replaces it.
    up = Secret.update(n.upper(), v2)
    assert (up.secret_id, up.version, up.metadata, up.created_at) == (made.secret_id, 2, {"team": "ml"}, made.created_at)
    assert up.updated_at >= made.updated_at
    up = Secret.update(made.secret_id, v2, metadata={"owner": "me"})
    assert (up.version, up.metadata) == (3, {"owner": "me"})
    up = Secret.update(n, v1, metadata={})
    assert (up.version, up.metadata) == (4, {})
    assert Secret.get_info(n).version == 4
    with pytest.raises(SecretNotFoundException):
        Secret.update(name(), v1)

    assert Secret.destroy(n.upper()) is True
    assert Secret.destroy(n) is False
    assert Secret.destroy(made.secret_id) is False
    assert Secret.exists(made.secret_id) is False


def test_a_taken_name_is_a_conflict():
    n = name()
    Secret.create(n, value())
    try:
        with pytest.raises(SecretException) as e:
            Secret.create(n.upper(), value())
        assert str(e.value).startswith("409")
        assert not isinstance(e.value, SecretNotFoundException)
    finally:
        Secret.destroy(n)


@pytest.mark.parametrize("bad", ["has space", "a/b", "", "x" * 129, "sec_reserved", "SEC_reserved", "dot.ted"])
def test_an_invalid_name_is_a_400(bad):
    v = value()
    with pytest.raises(SecretException) as e:
        Secret.create(bad, v)
    assert str(e.value).startswith("400"), e.value
    assert v not in str(e.value)


def test_metadata_limits_are_400():
    for meta in ({f"k{i}": "v" for i in range(33)}, {"k" * 129: "v"}, {"k": "v" * 1025}, {f"k{i}": "v" * 1024 for i in range(8)}):
        with pytest.raises(SecretException) as e:
            Secret.create(name(), value(), metadata=meta)
        assert str(e.value).startswith("400"), e.value


def test_list_page_by_page():
    made = [Secret.create(name(), value()) for _ in range(3)]
    try:
        everything = Secret.list().next_items()
        mine = [s.secret_id for s in everything if s.secret_id in {m.secret_id for m in made}]
        assert mine == [m.secret_id for m in made], "oldest first"
        # One page of one: the token leads to the next, and the last page has none.
        seen = []
        pages = Secret.list(limit=1)
        while pages.has_next:
            items = pages.next_items()
            assert len(items) <= 1
            seen += [s.secret_id for s in items]
        assert seen == [s.secret_id for s in everything]
        # A paginator started from a token goes on from there.
        first = Secret.list(limit=1)
        first.next_items()
        assert first.next_token
        rest = Secret.list(limit=100, next_token=first.next_token).next_items()
        assert [s.secret_id for s in rest] == [s.secret_id for s in everything[1:]]
        r = get("/secrets?limit=1")
        assert r.status_code == 200 and r.headers.get("x-next-token")
        assert get("/secrets?limit=0").status_code == 400
        assert get("/secrets?nextToken=not-one").status_code == 400
    finally:
        for m in made:
            Secret.destroy(m.secret_id)


def test_values_stay_on_disk_in_a_closed_store():
    v = value()
    n = name()
    made = Secret.create(n, v, metadata={"k": "meta"})
    try:
        st = os.stat(STORE)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == 0
        record = os.path.join(STORE, f"{made.secret_id}.json")
        st = os.stat(record)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        with open(record) as f:
            assert v in f.read(), "the value is kept (only) here"
        v2 = value()
        Secret.update(n, v2)
        assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
        # Every write went by rename: only records, no temporary file left behind.
        assert all(f.startswith("sec_") and f.endswith(".json") for f in os.listdir(STORE)), os.listdir(STORE)

        # No read answers the value, and no error quotes it.
        for path in ("/secrets", f"/secrets/{made.secret_id}", f"/secrets/{n}", "/secrets?limit=1"):
            r = get(path)
            assert r.status_code == 200 and v not in r.text and v2 not in r.text, path
        for body in ({"name": "bad name", "value": v}, {"name": n, "value": v}, {"name": name(), "value": v, "metadata": {"k": 1}}):
            r = httpx.post(API_URL + "/secrets", headers=HEADERS, json=body, timeout=30)
            assert r.status_code in (400, 409) and v not in r.text, r.text
    finally:
        Secret.destroy(made.secret_id)


def test_the_server_log_holds_no_value():
    log = os.environ.get("CORDON_SERVE_LOG")
    if not log:
        pytest.skip("CORDON_SERVE_LOG is not set: run.sh names the suite server's log in it")
    v = value()
    n = name()
    Secret.create(n, v)
    Secret.update(n, v + "-2")
    Secret.get_info(n)
    httpx.post(API_URL + "/secrets", headers=HEADERS, json={"name": "bad name", "value": v}, timeout=30)
    Secret.destroy(n)
    with open(log, errors="replace") as f:
        assert v not in f.read()


def test_secrets_are_read_back_by_a_new_server(tmp_path):
    v = value()
    n = name()
    made = Secret.create(n, v, metadata={"k": "v"})
    log_path = tmp_path / "serve.log"
    try:
        with open(log_path, "wb") as log:
            srv = Serve("-vv", "--state-dir", STATE, log=log).start()
        try:
            opts = {"api_url": srv.url, "api_key": API_KEY}
            info = Secret.get_info(n.upper(), **opts)
            assert (info.secret_id, info.version, info.metadata, info.created_at) == (made.secret_id, 1, {"k": "v"}, made.created_at)
            assert Secret.update(n, value(), **opts).version == 2
            assert v not in get(f"/secrets/{n}", srv.url).text
        finally:
            srv.stop()
        assert v not in log_path.read_text(errors="replace")
    finally:
        Secret.destroy(made.secret_id)


def test_the_api_key_is_required():
    r = httpx.get(API_URL + "/secrets", timeout=30)
    assert r.status_code == 401
    n = name()
    r = httpx.post(API_URL + "/secrets", headers={"X-API-KEY": "e2b_" + "1" * 40}, json={"name": n, "value": "y"}, timeout=30)
    assert r.status_code == 401
    assert Secret.exists(n) is False
