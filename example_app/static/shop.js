// The shop's checkout, enhanced: orders and payments go to the JSON API with one Idempotency-Key per
// operation, retried with that same key until the shop gives a final answer.
//
// An operation (placing one order, paying one order) gets a new random key when it starts. The key and
// the request body are kept in sessionStorage until a final answer arrives, so every resubmission of the
// operation sends the same key and the same body: a second click, "Try again" after a reload, a retry
// after a network error. Network errors, 409 (still in progress), 429 and 5xx gateway answers are retried
// by the page itself with capped exponential backoff and full jitter, honouring Retry-After, within a
// total deadline: the policy of flask_idem.client.RetryPolicy. Without JavaScript, or without the API key
// in this tab, the forms post to the server as they are, and the server is just as idempotent.
"use strict";

(() => {
  const POLICY = { attempts: 10, deadline: 60_000, base: 250, cap: 5_000, attemptTimeout: 15_000 };
  const RETRY_STATUSES = new Set([409, 429, 502, 503, 504]);
  const API_KEY = "shop.apiKey";
  const FLASH = "shop.flash";
  const finished = new Set(); // keys of operations that have had their final answer in this page

  const saved = {
    get(name) {
      try {
        return JSON.parse(sessionStorage.getItem(name));
      } catch {
        return null;
      }
    },
    set(name, value) {
      sessionStorage.setItem(name, JSON.stringify(value));
    },
    drop(name) {
      sessionStorage.removeItem(name);
    },
  };

  function newKey() {
    // crypto.randomUUID needs a secure context; getRandomValues works on plain http too.
    const b = crypto.getRandomValues(new Uint8Array(16));
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    const h = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
    return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
  }

  function parseRetryAfter(value) {
    if (!value) return null;
    value = value.trim();
    if (/^\d+$/.test(value)) return Number(value) * 1000;
    const when = Date.parse(value);
    return Number.isNaN(when) ? null : Math.max(0, when - Date.now());
  }

  // The wait after failed attempt n (1 for the first): full jitter, raised to Retry-After, capped.
  function backoff(n, response) {
    const ceiling = Math.min(POLICY.cap, POLICY.base * 2 ** (n - 1));
    let wait = Math.random() * ceiling;
    const asked = response ? parseRetryAfter(response.headers.get("Retry-After")) : null;
    if (asked !== null) wait = Math.min(POLICY.cap, Math.max(wait, asked));
    return wait;
  }

  // Waits ms, or less if the browser comes back online meanwhile.
  function sleep(ms) {
    return new Promise((resolve) => {
      const timer = setTimeout(done, ms);
      function done() {
        clearTimeout(timer);
        window.removeEventListener("online", done);
        resolve();
      }
      window.addEventListener("online", done);
    });
  }

  function money(cents, currency) {
    return `${Math.floor(cents / 100).toLocaleString("en")}.${String(cents % 100).padStart(2, "0")} ${currency}`;
  }

  function cents(text) {
    const match = /^(\d{1,9})(?:[.,](\d{1,2}))?$/.exec(text.trim());
    if (!match) return null;
    return Number(match[1]) * 100 + Number((match[2] || "0").padEnd(2, "0"));
  }

  const statusBox = document.getElementById("status");

  function show(kind, text, retry) {
    statusBox.hidden = false;
    statusBox.className = `status ${kind}`;
    statusBox.textContent = text;
    if (retry) {
      const button = document.createElement("button");
      button.type = "button";
      button.id = "try-again";
      button.textContent = "Try again";
      button.addEventListener("click", retry);
      statusBox.append(document.createElement("br"), button);
    }
  }

  function flashThenGo(kind, text, url) {
    saved.set(FLASH, { kind, text });
    window.location.assign(url);
  }

  async function detail(response) {
    try {
      const body = await response.json();
      return body.detail || body.title || `The shop answered ${response.status}.`;
    } catch {
      return `The shop answered ${response.status}.`;
    }
  }

  // What each kind of operation sends, and what its answers mean to a shopper.
  const KINDS = {
    order: {
      path: "/orders",
      storage: () => "shop.op.order",
      body(form) {
        const amount = cents(form.elements.amount.value);
        return amount ? { amount, currency: form.elements.currency.value } : null;
      },
      what: (body) => money(body.amount, body.currency),
      busy: "Placing your order…",
      inProgress: "Your order is still being placed. Waiting for the shop…",
      async done(response, data, replayed, op) {
        const text = replayed
          ? `Your order of ${KINDS.order.what(op.body)} was already placed; here it is (order ${data.id}).`
          : `Order ${data.id} placed: ${KINDS.order.what(op.body)}. Now pay it.`;
        flashThenGo(replayed ? "info" : "ok", text, `/checkout/${data.id}`);
      },
    },
    pay: {
      path: "/payments",
      storage: (form) => `shop.op.pay.${form.dataset.orderId}`,
      body(form) {
        const source = form.querySelector("input[name=source]:checked");
        return source ? { order_id: Number(form.dataset.orderId), source: source.value } : null;
      },
      what: (body) => `order ${body.order_id}`,
      busy: "Paying…",
      inProgress: "Your payment is in progress: the bank has not answered yet. Waiting…",
      async done(response, data, replayed) {
        const text = replayed
          ? `This payment was already made; here it is. Your card was charged once (${data.gateway_charge_id}).`
          : `Payment accepted: your card was charged once (${data.gateway_charge_id}).`;
        flashThenGo(replayed ? "info" : "ok", text, window.location.pathname);
      },
    },
  };

  // Final answers that are not a success: say what happened; return whether the operation is over.
  async function refused(kind, response) {
    if (response.status === 401) {
      show("error", "Your sign-in is no longer valid. Sign in again, then try again: nothing is placed twice.");
      return false;
    }
    const why = await detail(response);
    if (kind === "pay" && response.status === 402) {
      flashThenGo("error", "Your card was declined. Nothing was charged. Choose another card.", window.location.pathname);
    } else {
      show("error", why);
    }
    return true;
  }

  // Sends one operation until it has a final answer or the policy gives up.
  async function run(kind, op, form, button) {
    const spec = KINDS[kind];
    const started = Date.now();
    const apiKey = sessionStorage.getItem(API_KEY);
    if (button) button.setAttribute("aria-busy", "true");
    show("info", spec.busy);
    for (let n = 1; ; n++) {
      if (finished.has(op.key)) return;
      const left = started + POLICY.deadline - Date.now();
      let response = null;
      let offline = false;
      try {
        response = await fetch(spec.path, {
          method: "POST",
          headers: {
            "Authorization": `Bearer ${apiKey}`,
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Idempotency-Key": op.key,
          },
          body: JSON.stringify(op.body),
          credentials: "omit",
          cache: "no-store",
          signal: AbortSignal.timeout(Math.max(1, Math.min(POLICY.attemptTimeout, left))),
        });
      } catch {
        offline = !navigator.onLine;
      }
      if (finished.has(op.key)) return; // another submission of this operation got the answer first
      if (response && response.ok) {
        finished.add(op.key);
        saved.drop(op.storage);
        const data = await response.json();
        await spec.done(response, data, response.headers.get("Idempotent-Replayed") === "true", op);
        return;
      }
      if (response && !RETRY_STATUSES.has(response.status)) {
        if (await refused(kind, response)) {
          finished.add(op.key);
          saved.drop(op.storage);
        }
        if (button) button.removeAttribute("aria-busy");
        return;
      }
      const wait = backoff(n, response);
      if (n >= POLICY.attempts || Date.now() + wait >= started + POLICY.deadline) {
        if (button) button.removeAttribute("aria-busy");
        show(
          "error",
          `We could not reach the shop, so we do not know yet whether ${spec.what(op.body)} went through. ` +
            "Trying again is safe: it will not be done twice.",
          () => run(kind, op, form, button),
        );
        showPending(form);
        return;
      }
      if (response && response.status === 409) show("warn", spec.inProgress);
      else if (response) show("warn", "The shop is busy right now. Trying again in a moment…");
      else if (offline) show("warn", "You are offline. We will try again as soon as you are back online…");
      else show("warn", "Could not reach the shop. Trying again…");
      await sleep(wait);
    }
  }

  // Starts an operation, or resubmits the one still waiting for its final answer (same key, same body).
  function submit(kind, form, button) {
    const storage = KINDS[kind].storage(form);
    let op = saved.get(storage);
    if (!op || !op.key) {
      const body = KINDS[kind].body(form);
      if (!body) {
        show("error", "Please check the form: the amount must be a number such as 12.50.");
        return;
      }
      op = { key: newKey(), body, storage, started: Date.now() };
      saved.set(storage, op);
    }
    run(kind, op, form, button);
  }

  function showPending(form) {
    const kind = form.dataset.op;
    const box = document.querySelector(`[data-pending-for="${kind}"]`);
    const op = saved.get(KINDS[kind].storage(form));
    if (!box || !op) return;
    const what = box.querySelector("[data-pending-what]");
    if (what) what.textContent = KINDS[kind].what(op.body);
    box.hidden = false;
  }

  function enhance(form) {
    const kind = form.dataset.op;
    const button = form.querySelector("button[type=submit]");
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      submit(kind, form, button);
    });
    const box = document.querySelector(`[data-pending-for="${kind}"]`);
    if (box) {
      box.querySelector("[data-retry]")?.addEventListener("click", () => {
        box.hidden = true;
        submit(kind, form, button);
      });
      box.querySelector("[data-discard]")?.addEventListener("click", () => {
        saved.drop(KINDS[kind].storage(form));
        box.hidden = true;
        statusBox.hidden = true;
      });
    }
    if (saved.get(KINDS[kind].storage(form))) showPending(form);
  }

  document.addEventListener("DOMContentLoaded", () => {
    for (const form of document.querySelectorAll("form[data-sign-in]")) {
      form.addEventListener("submit", () => {
        sessionStorage.setItem(API_KEY, form.elements.api_key.value.trim());
      });
    }
    for (const form of document.querySelectorAll("form[data-sign-out]")) {
      form.addEventListener("submit", () => sessionStorage.clear());
    }
    const flash = saved.get(FLASH);
    if (flash) {
      saved.drop(FLASH);
      show(flash.kind, flash.text);
    }
    if (document.body.dataset.signedIn !== "true" || !sessionStorage.getItem(API_KEY)) return;
    for (const form of document.querySelectorAll("form[data-op]")) enhance(form);
  });
})();
