"""The webhook presets verify deliveries signed the providers' way: pure checks on headers and raw bytes.

Stripe's and Standard Webhooks' deliveries are signed with the providers' own libraries; GitHub's and
Shopify's, whose schemes are a plain HMAC, by hand as their documentation describes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
import stripe as stripe_library
from standardwebhooks.webhooks import Webhook
from werkzeug.datastructures import Headers

from flask_idem import webhooks
from flask_idem.errors import ConfigurationError, WebhookRejected

# Standard Webhooks secrets are whsec_ and base64; Stripe's start with whsec_ and are used as they are;
# GitHub's and Shopify's are any string. These three serve every preset.
SECRET = "whsec_" + base64.b64encode(b"the current secret, 32 bytes!!!").decode()
OLD = "whsec_" + base64.b64encode(b"the secret before, rotated away!").decode()
OTHER = "whsec_" + base64.b64encode(b"a secret of somebody else's hook").decode()

EVENT_ID = "evt_1NG8Du2eZvKYlo2CUI79vXWy"
BODY = json.dumps({"id": EVENT_ID, "object": "event", "type": "payment_intent.succeeded"}).encode()


def stripe_headers(secret: str, body: bytes, stamp: int) -> Headers:
    payload = body.decode()
    helper = getattr(stripe_library.WebhookSignature, "generate_signature_header", None)
    if helper is not None:  # stripe 16 and later: the documented helper for tests
        header = helper(payload, secret, timestamp=stamp)
    else:
        signature = stripe_library.WebhookSignature._compute_signature(f"{stamp}.{payload}", secret)
        header = f"t={stamp},v1={signature}"
    return Headers({"Stripe-Signature": header})


def standard_headers(secret: str, body: bytes, stamp: int) -> Headers:
    signature = Webhook(secret).sign(EVENT_ID, datetime.fromtimestamp(stamp, tz=UTC), body.decode())
    return Headers({"webhook-id": EVENT_ID, "webhook-timestamp": str(stamp), "webhook-signature": signature})


def github_headers(secret: str, body: bytes, stamp: int) -> Headers:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return Headers({"X-Hub-Signature-256": f"sha256={digest}", "X-GitHub-Delivery": EVENT_ID})


def shopify_headers(secret: str, body: bytes, stamp: int) -> Headers:
    digest = base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()
    return Headers({"X-Shopify-Hmac-Sha256": digest, "X-Shopify-Webhook-Id": EVENT_ID})


@dataclass(frozen=True)
class Preset:
    make: Callable[..., webhooks.Source]
    sign: Callable[[str, bytes, int], Headers]
    #: The header that carries the signature.
    signature_header: str
    #: Whether the provider signs a timestamp.
    timed: bool


PRESETS = {
    "stripe": Preset(webhooks.stripe, stripe_headers, "Stripe-Signature", True),
    "standard": Preset(webhooks.standard, standard_headers, "webhook-signature", True),
    "github": Preset(webhooks.github, github_headers, "X-Hub-Signature-256", False),
    "shopify": Preset(webhooks.shopify, shopify_headers, "X-Shopify-Hmac-Sha256", False),
}
ALL = pytest.mark.parametrize("preset", list(PRESETS.values()), ids=list(PRESETS))
TIMED = pytest.mark.parametrize(
    "preset", [PRESETS["stripe"], PRESETS["standard"]], ids=["stripe", "standard"]
)


def rejected(source: webhooks.Source, headers: Headers, body: bytes = BODY) -> WebhookRejected:
    with pytest.raises(WebhookRejected) as caught:
        source.verify(headers, body)
    return caught.value


def problem(exc: WebhookRejected) -> dict[str, object]:
    document: dict[str, object] = json.loads(exc.get_body())
    return document


@ALL
def test_a_signed_delivery_gives_its_event_id(preset: Preset) -> None:
    """A delivery signed with the source's secret verifies, and its event id is the provider's."""
    source = preset.make(SECRET)
    assert source.verify(preset.sign(SECRET, BODY, int(time.time())), BODY) == EVENT_ID


@ALL
def test_a_tampered_body_fails_the_signature_check(preset: Preset) -> None:
    """One changed byte of the body is a 400 naming the signature check."""
    headers = preset.sign(SECRET, BODY, int(time.time()))
    exc = rejected(preset.make(SECRET), headers, BODY.replace(b"succeeded", b"succeedeD"))
    assert exc.code == 400
    assert exc.check == "signature"
    assert problem(exc)["check"] == "signature"


@ALL
def test_another_secret_fails_the_signature_check_and_the_detail_keeps_the_secret(preset: Preset) -> None:
    """A delivery signed with another secret is refused, and neither the source's secret nor the
    signature it expected appears in the error or its body."""
    stamp = int(time.time())
    exc = rejected(preset.make(SECRET), preset.sign(OTHER, BODY, stamp))
    assert exc.check == "signature"
    expected = preset.sign(SECRET, BODY, stamp)[preset.signature_header]
    # The signature alone, without its scheme (t=...,v1=, v1, or sha256=) and base64 padding.
    bare = re.split("[=,]", expected.rstrip("="))[-1]
    assert len(bare) >= 40
    for text in (str(exc), exc.get_body(), repr(exc)):
        for hidden in (SECRET, SECRET.removeprefix("whsec_"), expected, bare):
            assert hidden not in text
    assert preset.signature_header in str(exc.description)


@ALL
def test_a_missing_signature_header_is_named(preset: Preset) -> None:
    """A delivery without the signature header is refused with check="header"."""
    headers = preset.sign(SECRET, BODY, int(time.time()))
    headers.remove(preset.signature_header)
    exc = rejected(preset.make(SECRET), headers)
    assert exc.check == "header"
    assert preset.signature_header in str(exc.description)


@ALL
def test_a_rotated_secret_accepts_the_old_and_the_new_and_nothing_else(preset: Preset) -> None:
    """With two secrets configured, a delivery signed with either verifies; one signed with a third
    does not."""
    source = preset.make([OLD, SECRET])
    stamp = int(time.time())
    assert source.verify(preset.sign(OLD, BODY, stamp), BODY) == EVENT_ID
    assert source.verify(preset.sign(SECRET, BODY, stamp), BODY) == EVENT_ID
    assert rejected(source, preset.sign(OTHER, BODY, stamp)).check == "signature"


@TIMED
@pytest.mark.parametrize(
    "offset", [-301, 301, -3600, 10**6], ids=["stale", "future", "hour-old", "far-future"]
)
def test_a_timestamp_outside_the_tolerance_is_refused(preset: Preset, offset: int) -> None:
    """A correctly signed delivery whose timestamp is more than five minutes away, either way (a
    captured delivery replayed, or a clock far ahead), fails the timestamp check."""
    headers = preset.sign(SECRET, BODY, int(time.time()) + offset)
    exc = rejected(preset.make(SECRET), headers)
    assert exc.check == "timestamp"
    assert problem(exc)["check"] == "timestamp"


@TIMED
def test_a_timestamp_within_the_tolerance_verifies(preset: Preset) -> None:
    """A delivery four minutes old, or with a clock a little ahead, is within the default tolerance."""
    source = preset.make(SECRET)
    for offset in (-240, 30):
        assert source.verify(preset.sign(SECRET, BODY, int(time.time()) + offset), BODY) == EVENT_ID


@TIMED
def test_a_narrower_tolerance_refuses_what_the_default_accepts(preset: Preset) -> None:
    """tolerance=60 refuses a delivery two minutes old."""
    headers = preset.sign(SECRET, BODY, int(time.time()) - 120)
    assert rejected(preset.make(SECRET, tolerance=60), headers).check == "timestamp"


def test_stripe_widens_the_tolerance_on_request() -> None:
    """webhooks.stripe(tolerance=...) accepts a delivery older than five minutes within it."""
    headers = stripe_headers(SECRET, BODY, int(time.time()) - 600)
    assert webhooks.stripe(SECRET, tolerance=900).verify(headers, BODY) == EVENT_ID


@pytest.mark.parametrize(
    "header",
    ["v1=abc", "t=,v1=abc", "t=12x,v1=abc", "t=1_700_000_000,v1=abc", f"t={'9' * 40},v1=abc"],
    ids=["no-t", "empty-t", "not-a-number", "underscores", "huge"],
)
def test_stripe_without_a_usable_timestamp_fails_the_timestamp_check(header: str) -> None:
    """A Stripe-Signature header without a timestamp in whole seconds is refused, not a 500."""
    exc = rejected(webhooks.stripe(SECRET), Headers({"Stripe-Signature": header}))
    assert exc.check == "timestamp"


def test_stripe_takes_the_event_id_from_the_body() -> None:
    """A verified Stripe delivery whose body has no id is refused with check="event-id"; one that is
    not JSON with check="body"."""
    source = webhooks.stripe(SECRET)
    stamp = int(time.time())
    no_id = json.dumps({"object": "event"}).encode()
    assert rejected(source, stripe_headers(SECRET, no_id, stamp), no_id).check == "event-id"
    not_json = b"evt_1 paid"
    assert rejected(source, stripe_headers(SECRET, not_json, stamp), not_json).check == "body"


@pytest.mark.parametrize(
    ("preset", "header"),
    [(PRESETS["github"], "X-GitHub-Delivery"), (PRESETS["shopify"], "X-Shopify-Webhook-Id")],
    ids=["github", "shopify"],
)
def test_a_signed_delivery_without_its_event_id_header_is_refused(preset: Preset, header: str) -> None:
    """GitHub's and Shopify's event ids come from a header; without it the delivery is refused with
    check="event-id" (nothing could tell a redelivery from a new event)."""
    headers = preset.sign(SECRET, BODY, int(time.time()))
    headers.remove(header)
    assert rejected(preset.make(SECRET), headers).check == "event-id"


@pytest.mark.parametrize(
    "missing", ["webhook-id", "webhook-timestamp"], ids=["without-id", "without-timestamp"]
)
def test_standard_needs_its_three_headers(missing: str) -> None:
    """Each of the headers a Standard Webhooks signature covers is required."""
    headers = standard_headers(SECRET, BODY, int(time.time()))
    headers.remove(missing)
    exc = rejected(webhooks.standard(SECRET), headers)
    assert exc.check == "header"
    assert missing in str(exc.description)


@pytest.mark.parametrize(
    "signature",
    ["v1", "v1,not base64!", "v2,abc v1", "garbage"],
    ids=["bare", "bad-base64", "odd", "garbage"],
)
def test_standard_refuses_a_malformed_signature_list(signature: str) -> None:
    """A malformed webhook-signature is a signature failure, not a 500."""
    headers = standard_headers(SECRET, BODY, int(time.time()))
    headers["webhook-signature"] = signature
    assert rejected(webhooks.standard(SECRET), headers).check == "signature"


@pytest.mark.parametrize(
    ("preset", "value"),
    [(PRESETS["github"], "sha256=é"), (PRESETS["github"], "md5=abc"), (PRESETS["shopify"], "ünïcode")],
    ids=["github-non-ascii", "github-other-scheme", "shopify-non-ascii"],
)
def test_a_malformed_signature_header_is_refused(preset: Preset, value: str) -> None:
    """A signature header with another scheme or non-ASCII characters is refused, not a 500."""
    headers = preset.sign(SECRET, BODY, int(time.time()))
    headers[preset.signature_header] = value
    assert rejected(preset.make(SECRET), headers).check in {"header", "signature"}


@ALL
def test_a_body_that_is_not_utf8_is_refused(preset: Preset) -> None:
    """Stripe and Standard Webhooks sign text: a body that is not UTF-8 is refused with check="body";
    GitHub and Shopify sign bytes, so a tampered body fails their signature."""
    headers = preset.sign(SECRET, BODY, int(time.time()))
    exc = rejected(preset.make(SECRET), headers, BODY + b"\xff")
    assert exc.check == ("body" if preset.timed else "signature")


@ALL
@pytest.mark.parametrize("secret", ["", [], ["", SECRET]], ids=["empty", "no-secrets", "one-empty"])
def test_a_preset_needs_a_secret(preset: Preset, secret: object) -> None:
    """An empty secret is a configuration error when the source is made."""
    with pytest.raises(ConfigurationError, match="needs a secret"):
        preset.make(secret)


def test_standard_refuses_a_tolerance_wider_than_its_library() -> None:
    """The standardwebhooks library refuses timestamps five minutes away itself; a wider tolerance is
    a configuration error rather than a promise the source cannot keep."""
    with pytest.raises(ConfigurationError, match="at most 300"):
        webhooks.standard(SECRET, tolerance=600)


@pytest.mark.parametrize(
    "secret", ["whsec_", "whsec_!!!!", "whsec_===="], ids=["empty", "not-base64", "padding-only"]
)
def test_standard_refuses_a_secret_that_is_not_base64(secret: str) -> None:
    """A Standard Webhooks secret is whsec_ and a key in base64; another is refused when the source is
    made."""
    with pytest.raises(ConfigurationError, match="whsec_"):
        webhooks.standard([SECRET, secret])


@pytest.mark.parametrize(
    ("module", "make", "extra"),
    [
        ("stripe", webhooks.stripe, "flask-idem[stripe]"),
        ("standardwebhooks", webhooks.standard, "flask-idem[standardwebhooks]"),
    ],
    ids=["stripe", "standard"],
)
def test_a_missing_library_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, make: Callable[..., webhooks.Source], extra: str
) -> None:
    """Without the provider's library, making the source says which extra to install."""
    for name in [name for name in sys.modules if name == module or name.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigurationError, match=extra.replace("[", r"\[")):
        make(SECRET)
