"""The shop's web front end: sign in, place an order, pay it, and see the organisation's orders.

Pages are rendered on the server (``templates/``) and work without JavaScript: every form posts to a
route of this module that is itself idempotent, taking its key from a hidden ``idempotency_key`` field
created when the form was rendered (``@idem.idempotent(key_from=...)``), so a form submitted twice (a
double click, "Resubmit?" after a reload) still places one order and makes one charge.

With JavaScript (``static/shop.js``), the same forms call the JSON API instead (``POST /orders``,
``POST /payments``) with the organisation's API key and an ``Idempotency-Key`` that is kept in
``sessionStorage`` until the operation has a final answer, and retried with the same key.

Signing in checks an organisation's API key once and keeps the organisation in Flask's signed session
cookie (HttpOnly, SameSite=Lax). Every form post carries a CSRF token bound to that session. Keys never
appear in URLs: all writes are POSTs with the key in the body or a header.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import uuid
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from flask import (
    Blueprint,
    Flask,
    Response,
    abort,
    current_app,
    g,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from flask.typing import ResponseReturnValue
from psycopg import sql
from werkzeug.exceptions import Forbidden, HTTPException, NotFound, UnprocessableEntity

from flask_idem import Flow, Run
from flask_idem.errors import problem

from . import fulfilment, payments
from .auth import hash_api_key
from .extensions import idem

__all__ = ["CURRENCIES", "TEST_CARDS", "bp", "init_app"]

bp = Blueprint("web", __name__)

#: The currencies the checkout offers; each has two decimal places.
CURRENCIES = ("EUR", "USD", "GBP", "CHF")

#: The gateway simulator's test tokens the checkout offers; a token ending in ``decline`` is declined.
TEST_CARDS = {
    "tok_visa": "Visa ending 4242 (approved)",
    "tok_mastercard": "Mastercard ending 4444 (approved)",
    "tok_card_decline": "Card that the bank declines",
}

#: How the orders page names each payment state (``None``: no payment yet).
PAYMENT_LABELS = {
    None: "not paid",
    "pending": "in progress",
    "succeeded": "paid",
    "declined": "declined",
    "failed": "failed",
}

#: Sent with every page and static file of the front end. No inline script or style is allowed, no
#: other site may frame the pages, and scripts may only talk to the shop itself.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self';"
        " form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

_KEY_FIELD = "idempotency_key"
_CSRF_FIELD = "csrf_token"
_AMOUNT = re.compile(r"\d{1,9}(?:[.,]\d{1,2})?")
_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


def init_app(app: Flask) -> None:
    """Add the front end to ``app``: the blueprint, the session cookie settings, the security headers.

    ``SECRET_KEY`` signs the session cookie. Without one, a random key is created once in the instance
    folder, so every worker process of the shop uses the same key.
    """
    if not app.config.get("SECRET_KEY"):
        app.config["SECRET_KEY"] = _instance_secret(Path(app.instance_path) / "secret_key")
    if app.config.get("SESSION_COOKIE_SAMESITE") is None:
        app.config["SESSION_COOKIE_SAMESITE"] = "Lax"
    app.config["SESSION_COOKIE_HTTPONLY"] = True
    app.config.setdefault("SHOP_DEMO_API_KEY", None)
    app.register_blueprint(bp)
    app.after_request(_security_headers)


def _instance_secret(path: Path) -> str:
    """The secret in ``path``, created at random if missing (safe when several processes race)."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    try:
        os.link(draft, path)  # atomic: the first process's secret wins, whole
    except FileExistsError:
        pass
    finally:
        draft.unlink()
    return path.read_text().strip()


def _security_headers(response: Response) -> Response:
    if request.blueprint == bp.name or request.endpoint == "static":
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        if request.blueprint == bp.name:
            # Pages hold the session's CSRF token and fresh idempotency keys: never cache them.
            response.headers.setdefault("Cache-Control", "no-store")
    return response


def _signed_in_org() -> tuple[int, str] | None:
    """The session's organisation (id, name), if its API key is still valid."""
    org_id, key_sha = session.get("org_id"), session.get("key_sha")
    if not isinstance(org_id, int) or not isinstance(key_sha, str):
        return None
    with idem.pool.connection() as conn:
        row = conn.execute(
            "SELECT id, name FROM orgs WHERE id = %s AND api_key_sha = %s AND revoked_at IS NULL",
            (org_id, bytes.fromhex(key_sha)),
        ).fetchone()
    return None if row is None else (row[0], row[1])


@bp.before_request
def _before() -> None:
    """Check the CSRF token of every form post, then find the session's organisation."""
    if "csrf" not in session:
        session["csrf"] = secrets.token_urlsafe(32)
    if request.method not in _SAFE:
        request.get_data(cache=True)  # kept whole for the fingerprint of idempotent form routes
        sent = request.form.get(_CSRF_FIELD, "")
        if not hmac.compare_digest(sent.encode(), str(session["csrf"]).encode()):
            raise Forbidden(
                "The form has expired or did not come from this shop. Reload the page and try again."
            )
    org = _signed_in_org()
    if org is not None:
        g.org_id, g.org_name = org


@bp.app_context_processor
def _template_globals() -> dict[str, Any]:
    return {
        "csrf_token": session.get("csrf", ""),
        "org_name": g.get("org_name"),
        "money": money,
    }


def money(amount: int, currency: str) -> str:
    """``1250, "EUR"`` -> ``"12.50 EUR"``: minor units shown with their two decimals."""
    return f"{amount // 100:,}.{amount % 100:02d} {currency}"


def _require_org() -> int:
    org_id: int | None = g.get("org_id")
    if org_id is None:
        abort(redirect(url_for(".index"), 303))
    return org_id


def _form_key() -> list[str]:
    return request.form.getlist(_KEY_FIELD)


def new_key() -> str:
    """A fresh idempotency key for a form being rendered."""
    return str(uuid.uuid4())


@bp.get("/")
def index() -> str:
    """The front page: sign in, or the checkout once signed in."""
    if g.get("org_id") is None:
        return render_template("sign_in.html", demo_api_key=current_app.config["SHOP_DEMO_API_KEY"])
    return render_template("checkout.html", key=new_key(), currencies=CURRENCIES)


@bp.post("/sign-in")
def sign_in() -> ResponseReturnValue:
    """Sign in with an organisation's API key (sent in the form body, never in the URL)."""
    api_key = request.form.get("api_key", "").strip()
    row = None
    if 20 <= len(api_key) <= 128 and api_key.isascii():
        with idem.pool.connection() as conn:
            row = conn.execute(
                "SELECT id FROM orgs WHERE api_key_sha = %s AND revoked_at IS NULL",
                (hash_api_key(api_key),),
            ).fetchone()
    if row is None:
        page = render_template(
            "sign_in.html",
            demo_api_key=current_app.config["SHOP_DEMO_API_KEY"],
            error="That API key is unknown or revoked.",
        )
        return page, 401
    session.clear()
    session["csrf"] = secrets.token_urlsafe(32)
    session["org_id"] = row[0]
    session["key_sha"] = hash_api_key(api_key).hex()
    return redirect(url_for(".index"), 303)


@bp.post("/sign-out")
def sign_out() -> ResponseReturnValue:
    """Forget the session's organisation."""
    session.clear()
    return redirect(url_for(".index"), 303)


def _amount_in_cents(text: str) -> int:
    if not _AMOUNT.fullmatch(text.strip()):
        raise UnprocessableEntity("The amount must be a number such as 12.50.")
    try:
        cents = int(Decimal(text.strip().replace(",", ".")) * 100)
    except InvalidOperation:
        raise UnprocessableEntity("The amount must be a number such as 12.50.") from None
    if cents < 1:
        raise UnprocessableEntity("The amount must be at least 0.01.")
    return cents


@bp.post("/checkout")
@idem.idempotent(key_from=_form_key)
def place_order() -> ResponseReturnValue:
    """The checkout form without JavaScript: place the order, then show it (Post/Redirect/Get)."""
    org_id = _require_org()
    amount = _amount_in_cents(request.form.get("amount", ""))
    currency = request.form.get("currency", "")
    if currency not in CURRENCIES:
        raise UnprocessableEntity("Choose one of the offered currencies.")
    row = idem.connection.execute(
        "INSERT INTO orders (org_id, idempotency_key, amount, currency) VALUES (%s, %s, %s, %s)"
        " ON CONFLICT (org_id, idempotency_key) DO NOTHING RETURNING id",
        (org_id, idem.key, amount, currency),
    ).fetchone()
    if row is None:
        raise UnprocessableEntity("An order was already placed with this form. Start a new order.")
    return redirect(url_for(".order_page", order_id=row[0]), 303)


def _order_with_payment(org_id: int, order_id: int) -> dict[str, Any]:
    with idem.pool.connection() as conn:
        row = conn.execute(
            "SELECT o.id, o.amount, o.currency, o.created_at, p.status, p.gateway_charge_id"
            " FROM orders o LEFT JOIN LATERAL ("
            "   SELECT status, gateway_charge_id FROM payments"
            "   WHERE org_id = o.org_id AND order_id = o.id ORDER BY id DESC LIMIT 1"
            " ) p ON true WHERE o.id = %s AND o.org_id = %s",
            (order_id, org_id),
        ).fetchone()
    if row is None:
        raise NotFound("There is no such order.")
    keys = ("id", "amount", "currency", "created_at", "payment", "charge_id")
    return dict(zip(keys, row, strict=True))


@bp.get("/checkout/<int:order_id>")
def order_page(order_id: int) -> str:
    """One order: its payment state, and the payment form while it can still be paid."""
    org_id = _require_org()
    order = _order_with_payment(org_id, order_id)
    return render_template("order.html", order=order, key=new_key(), cards=TEST_CARDS)


web_pay = Flow("shop.web.pay")


@bp.post("/checkout/<int:order_id>/pay")
@idem.idempotent(flow=web_pay, key_from=_form_key)
def pay_order(order_id: int) -> dict[str, Any]:
    """The payment form without JavaScript: the same three steps as ``POST /payments``."""
    org_id = _require_org()
    source = request.form.get("source", "")
    if source not in TEST_CARDS:
        raise UnprocessableEntity("Choose one of the offered test cards.")
    conn = idem.connection
    order = conn.execute(
        "SELECT amount, currency FROM orders WHERE id = %s AND org_id = %s FOR UPDATE", (order_id, org_id)
    ).fetchone()
    if order is None:
        raise NotFound("There is no such order.")
    row = conn.execute(
        # No arbiter: a conflict on the key, or on payments_one_live_per_order (the order is paid or being
        # paid), inserts nothing; the order's row lock above keeps payments of one order in turn.
        "INSERT INTO payments (org_id, order_id, idempotency_key, amount, currency)"
        " VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING id",
        (org_id, order_id, idem.key, *order),
    ).fetchone()
    if row is None:
        raise UnprocessableEntity("This order is already paid, or a payment for it is in progress.")
    amount, currency = order
    return {
        "payment_id": row[0],
        "order_id": order_id,
        "amount": amount,
        "currency": currency,
        "source": source,
        # Built here, in the request: the finish step may run in the recovery job, which has none.
        "location": url_for("web.order_page", order_id=order_id),
    }


# The charge step is the API's own (``payments.charge``): same intent fields, same derived key, same
# resolver. A function may be a step of several flows; each records it under its own name, "charge".
web_pay.call(resolve=payments.find_charge)(payments.charge)


@web_pay.finish
def record(run: Run) -> ResponseReturnValue:
    """Record the gateway's answer and show the order, which now says how the payment went."""
    outcome = run.results["charge"]
    status = outcome["status"] if outcome["status"] in ("succeeded", "declined") else "failed"
    run.connection.execute(
        "UPDATE payments SET status = %s, gateway_charge_id = %s, updated_at = now()"
        " WHERE org_id = %s AND id = %s",
        (status, outcome["charge_id"], run.org_id, run.intent["payment_id"]),
    )
    fulfilment.after_payment(run, outcome)  # the fulfilment task's message, in this transaction
    return redirect(run.intent["location"], 303)


#: Each order once, with its latest payment, and whether flask-idem flagged that payment for a person.
_ORDERS_PAGE = sql.SQL(
    "SELECT o.id, o.amount, o.currency, o.created_at, p.status, p.gateway_charge_id,"
    " COALESCE(p.needs_attention, false)"
    " FROM orders o LEFT JOIN LATERAL ("
    "   SELECT py.status, py.gateway_charge_id, EXISTS ("
    "     SELECT FROM {keys} k WHERE k.org_id = py.org_id AND k.idem_key = py.idempotency_key"
    "     AND k.needs_attention"
    "   ) AS needs_attention"
    "   FROM payments py WHERE py.org_id = o.org_id AND py.order_id = o.id ORDER BY py.id DESC LIMIT 1"
    " ) p ON true WHERE o.org_id = %s ORDER BY o.id DESC"
)


@bp.get("/account/orders")
def orders_page() -> str:
    """The organisation's orders, once each, with their payment state; flagged payments come first."""
    org_id = _require_org()
    table = sql.Identifier(*idem.settings.table.split("."))
    with idem.pool.connection() as conn:
        rows = conn.execute(_ORDERS_PAGE.format(keys=table), (org_id,)).fetchall()
    keys = ("id", "amount", "currency", "created_at", "payment", "charge_id", "needs_attention")
    orders = [dict(zip(keys, row, strict=True)) for row in rows]
    flagged = [o for o in orders if o["needs_attention"]]
    return render_template("orders.html", orders=orders, flagged=flagged, payment_labels=PAYMENT_LABELS)


@bp.errorhandler(HTTPException)
def _error_page(e: HTTPException) -> Response:
    """Errors of the front end's routes: an HTML page for a browser, problem+json for anything else.

    A 409 (the same form is still being processed) offers the very same form again, key included.
    """
    if request.accept_mimetypes.best_match(["application/problem+json", "text/html"]) != "text/html":
        return problem(e)
    resend = None
    if e.code in _RESEND and request.method == "POST" and request.endpoint != "web.sign_in":
        resend = list(request.form.items(multi=True))
    page = render_template("error.html", error=e, resend=resend, action=request.path)
    response = current_app.make_response((page, e.code or 500))
    retry_after = dict(e.get_headers()).get("Retry-After")
    if retry_after:
        response.headers["Retry-After"] = retry_after
    return response


#: Answers after which the very same form may be sent again: in flight (409), or unavailable for now.
_RESEND = frozenset({409, 502, 503, 504})
