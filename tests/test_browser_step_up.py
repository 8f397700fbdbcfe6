"""Step-up in a real browser: Debian's Chromium (Playwright) with the DevTools protocol's virtual authenticator.

A call under a ``step_up`` policy has no Approve on any chat card (Telegram's, on the wire fake) nor as a form
on its page; the page approves only after a fresh WebAuthn assertion with user verification, which Kazma
verifies with py_webauthn. Attacked: the page's own decide form posted with Approve (a signed-in session is
not a passkey assertion); an authenticator that does not verify its user; an assertion answering another
request's challenge. Deny stays one press.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from playwright.async_api import Page, async_playwright

from kazma.approvals.model import Status
from tests.test_browser import ARTIFACTS, CHAT, Running, kazma_with_console, login

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/install-test-deps)")

POLICY = ", policies: {production: {step_up: true}}"
TOOLS = "tools:\n  deploy: {policy: production}\n"


async def _post_from_page(page: Page, path: str, form: dict[str, str]) -> int:
    """A POST the page itself makes (same origin, its cookies): what a script in a signed-in tab could do."""
    status = await page.evaluate(
        """async ([path, form]) => {
            const body = new URLSearchParams(form);
            const r = await fetch(path, {method: "POST", body, credentials: "same-origin", redirect: "manual"});
            return r.status;
        }""",
        [path, form],
    )
    return int(status)


async def _pending(k: Running, request_id: str) -> bool:
    row = await k.app.service.store.get(request_id)
    return row is not None and row.status is Status.PENDING


async def test_step_up_approves_only_with_a_fresh_passkey_assertion(tmp_path: Path) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    async with kazma_with_console(tmp_path, approvals=POLICY, extra=TOOLS) as k, async_playwright() as pw:
        request = await k.app.service.open("deploy", {"env": "prod"}, "agent:builder", "web:console")
        other = await k.app.service.open("deploy", {"env": "staging"}, "agent:builder", "web:console")
        assert request.step_up
        await k.telegram.wait_until(
            lambda: len([m for m in k.telegram.bot_messages(CHAT) if m.buttons]) == 2, timeout=30
        )
        for card in [m for m in k.telegram.bot_messages(CHAT) if m.buttons]:
            assert [b["text"] for b in card.buttons if b.get("callback_data")] == [
                "Deny",
                "Deny with reason",
            ]  # no Approve in chat
            assert "with your passkey" in card.text

        browser = await pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        try:
            page = await (await browser.new_context(viewport={"width": 1280, "height": 1000})).new_page()
            cdp = await login(page, k)  # enrols alice's passkey, and signs her in with it
            await page.goto(f"{k.base}/swarm?approval={request.id}")
            assert await page.locator(f"#b-{request.id} button.approve").count() == 0  # no plain Approve form
            assert await page.locator("#passkey-step-up").count() == 1
            await page.screenshot(path=str(ARTIFACTS / "step-up-page.png"), full_page=True)

            # attack: a signed-in session posting Approve to the decide form is not a passkey assertion
            csrf = await page.locator(f"#b-{request.id} input[name=csrf]").first.get_attribute("value")
            assert csrf
            posted = await _post_from_page(
                page, f"/approvals/{request.id}/decide", {"csrf": csrf, "decision": "approve", "next": "/"}
            )
            assert posted in (0, 303)  # the form answered (a redirect back), and decided nothing
            assert await _pending(k, request.id)

            # attack: an authenticator that does not verify its user gives no approval
            authenticator = cdp.authenticator_id
            await cdp.session.send(
                "WebAuthn.setUserVerified", {"authenticatorId": authenticator, "isUserVerified": False}
            )
            await page.goto(f"{k.base}/swarm?approval={request.id}")
            await page.click("#passkey-step-up")
            refusal = page.locator("#passkey-error")
            await refusal.wait_for(state="visible", timeout=20_000)
            assert await _pending(k, request.id)

            # attack: an assertion for the other request's challenge does not approve this one
            await cdp.session.send(
                "WebAuthn.setUserVerified", {"authenticatorId": authenticator, "isUserVerified": True}
            )
            crossed = await page.evaluate(
                """async ([other, target, csrf]) => {
                    const h = {"Content-Type": "application/json", "X-CSRF-Token": csrf};
                    const b64 = (buf) => btoa(String.fromCharCode(...new Uint8Array(buf)))
                        .replace(/\\+/g, "-").replace(/\\//g, "_").replace(/=+$/, "");
                    const from = (s) => Uint8Array.from(atob(s.replace(/-/g, "+").replace(/_/g, "/")
                        + "===".slice((s.length + 3) % 4)), c => c.charCodeAt(0));
                    const opts = await (await fetch(`/approvals/${other}/step-up/options`,
                        {method: "POST", headers: h, body: "{}", credentials: "same-origin"})).json();
                    const key = opts.publicKey;
                    key.challenge = from(key.challenge);
                    key.allowCredentials = key.allowCredentials.map(c => ({...c, id: from(c.id)}));
                    const got = await navigator.credentials.get({publicKey: key});
                    const answer = {id: got.id, rawId: b64(got.rawId), type: got.type, response: {
                        clientDataJSON: b64(got.response.clientDataJSON),
                        authenticatorData: b64(got.response.authenticatorData),
                        signature: b64(got.response.signature),
                        userHandle: got.response.userHandle ? b64(got.response.userHandle) : null},
                        clientExtensionResults: {}};
                    const r = await fetch(`/approvals/${target}/step-up`,
                        {method: "POST", headers: h, body: JSON.stringify(answer), credentials: "same-origin"});
                    return r.status;
                }""",
                [other.id, request.id, csrf],
            )
            assert crossed == 409
            assert await _pending(k, request.id)
            assert await _pending(k, other.id)

            # the person, verified by their passkey, approves: the one press that counts
            await page.goto(f"{k.base}/swarm?approval={request.id}")
            await page.click("#passkey-step-up")
            await page.locator(".flash", has_text="Approved. Recorded as alice (web:alice).").wait_for(timeout=20_000)
            await page.screenshot(path=str(ARTIFACTS / "step-up-approved.png"), full_page=True)
            row = await k.app.service.store.get(request.id)
            assert row is not None
            assert (row.status, row.decided_by, row.decided_person) == (Status.APPROVED, "web:alice", "alice")
            await k.app.service.verify_execution(request.id, "deploy", {"env": "prod"})
            refused = await k.app.service.store.events(request.id, event="press_refused")
            assert any("step_up" in (e.detail or "") for e in refused)  # the form's Approve, audited
            await k.telegram.wait_until(
                lambda: any("APPROVED by alice (web:alice)" in m.text and not m.buttons
                            for m in k.telegram.bot_messages(CHAT)),
                timeout=30,
            )  # fmt: skip

            # Deny stays one press: the page's Deny form
            await page.goto(f"{k.base}/swarm?approval={other.id}")
            await page.click(f"#b-{other.id} button.deny")
            await page.locator(".flash", has_text="Denied.").wait_for(timeout=20_000)
            assert (await k.app.service.store.get(other.id)).status is Status.DENIED  # type: ignore[union-attr]
        finally:
            await browser.close()
