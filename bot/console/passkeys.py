"""Passkeys (WebAuthn) for the console, through ``py_webauthn``: the options a browser is given, and the check
of what its authenticator answers. Nothing here speaks HTTP (:mod:`~kazma.bot.console.signin` does).

Every passkey Kazma asks for is a *resident* (discoverable) credential — the authenticator says whose it is,
so signing in needs no name typed — and every ceremony requires *user verification* (a PIN, a fingerprint, a
face): a passkey proves a person, not only a device someone holds. The relying party is the host of
``web.public_url``; a browser gives a passkey only to pages of that host, so a page elsewhere (a phishing
copy) can never obtain one of its signatures. An IP address cannot be a relying party (browsers refuse one):
the console must be reached by a name (``localhost`` on this machine) for passkeys to work.

py_webauthn is imported at the first ceremony, not with the console: most starts see none.

Signatures are checked by the library against the public key kept at enrolment, with the challenge Kazma
made (single use), the relying party and the origin, and the signature counter must move on (a cloned
authenticator replaying an old counter is refused). :func:`verify_assertion` is the one check every
assertion goes through: signing in, and a fresh assertion asked for one person (a step-up).
"""

from __future__ import annotations

import base64
import ipaddress
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from yarl import URL

from kazma.bot.console.accounts import Passkey

LOOPBACK_NAMES = ("localhost",)
CEREMONY_MILLISECONDS = 120_000  # how long the browser waits for the person


class PasskeyRefused(Exception):
    """What an authenticator answered does not prove what was asked: the reason, for the person."""


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def from_b64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class RelyingParty:
    """Who passkeys are made for: the console at ``web.public_url``."""

    id: str  # the host name
    origin: str  # scheme://host[:port] of the public URL
    name: str = "Kazma"

    @classmethod
    def of(cls, public_url: str) -> RelyingParty:
        parts = urlsplit(public_url)
        host = (parts.hostname or "").lower()
        # As a browser serialises the page's origin into the signed client data: lower case, no default port
        # (https://kazma.example.org:443 in web.public_url refused every passkey), no user info.
        origin = str(URL(public_url).origin()) if host else ""
        return cls(id=host, origin=origin)

    @property
    def problem(self) -> str | None:
        """Why passkeys cannot work at this public URL, or None."""
        try:
            ipaddress.ip_address(self.id)
        except ValueError:
            return None if self.id else "web.public_url names no host"
        return (
            f"web.public_url names the address {self.id}, and browsers make passkeys only for a name: open the "
            "console by name (on this machine: set web.public_url to http://localhost:<port>; elsewhere: your "
            "https:// domain)"
        )

    def origins(self, request_origin: str) -> list[str]:
        """The origins an answer may come from: the public URL's; on this machine (``localhost``) also the page's
        own, whatever its port (a test server, ``kazma demo``), since nobody else can serve that host."""
        found = [self.origin]
        if self.id in LOOPBACK_NAMES and (urlsplit(request_origin).hostname or "").lower() == self.id:
            found.append(request_origin.lower())
        return found


def enrolment_options(
    rp: RelyingParty, *, challenge: bytes, user_handle: str, person: str, display: str, exclude: list[str]
) -> dict[str, Any]:
    """What ``navigator.credentials.create`` is given: a resident key, user verification required, no
    attestation asked (Kazma trusts the person holding the invite, not a vendor's certificate)."""
    from webauthn import generate_registration_options, options_to_json
    from webauthn.helpers.structs import (
        AuthenticatorSelectionCriteria,
        PublicKeyCredentialDescriptor,
        ResidentKeyRequirement,
        UserVerificationRequirement,
    )

    options = generate_registration_options(
        rp_id=rp.id,
        rp_name=rp.name,
        user_name=person,
        user_id=from_b64url(user_handle),
        user_display_name=display,
        challenge=challenge,
        timeout=CEREMONY_MILLISECONDS,
        authenticator_selection=AuthenticatorSelectionCriteria(
            resident_key=ResidentKeyRequirement.REQUIRED,
            user_verification=UserVerificationRequirement.REQUIRED,
        ),
        exclude_credentials=[PublicKeyCredentialDescriptor(id=from_b64url(c)) for c in exclude],
    )
    loaded: dict[str, Any] = json.loads(options_to_json(options))
    return loaded


def assertion_options(rp: RelyingParty, *, challenge: bytes, allow: list[str] | None = None) -> dict[str, Any]:
    """What ``navigator.credentials.get`` is given: user verification required; ``allow`` None lets the
    authenticator offer any passkey it holds for this console (it says whose), a list only those."""
    from webauthn import generate_authentication_options, options_to_json
    from webauthn.helpers.structs import PublicKeyCredentialDescriptor, UserVerificationRequirement

    options = generate_authentication_options(
        rp_id=rp.id,
        challenge=challenge,
        timeout=CEREMONY_MILLISECONDS,
        allow_credentials=[PublicKeyCredentialDescriptor(id=from_b64url(c)) for c in allow or []],
        user_verification=UserVerificationRequirement.REQUIRED,
    )
    loaded: dict[str, Any] = json.loads(options_to_json(options))
    return loaded


def credential_id_of(answer: Any) -> str:
    """The credential an answer is about (as the browser names it), or raises :class:`PasskeyRefused`."""
    if not isinstance(answer, dict) or not isinstance(answer.get("id"), str) or not answer["id"]:
        raise PasskeyRefused("the browser's answer names no passkey")
    return str(answer["id"])


def verify_enrolment(
    rp: RelyingParty, answer: Any, *, challenge: str, origins: list[str], person: str, label: str
) -> Passkey:
    """The new passkey, once the library checked the answer against our challenge, relying party and origin,
    with the person verified by the authenticator."""
    from webauthn import verify_registration_response
    from webauthn.helpers.exceptions import WebAuthnException

    try:
        verified = verify_registration_response(
            credential=answer,
            expected_challenge=from_b64url(challenge),
            expected_rp_id=rp.id,
            expected_origin=origins,
            require_user_verification=True,
        )
    except (WebAuthnException, ValueError, KeyError, TypeError) as exc:
        raise PasskeyRefused(f"the passkey was not accepted: {exc}") from None
    return Passkey(
        credential_id=b64url(verified.credential_id),
        person=person,
        public_key=b64url(verified.credential_public_key),
        sign_count=verified.sign_count,
        label=label,
        created_at=0.0,
        last_used_at=None,
        revoked_at=None,
        revoked_by=None,
    )


def verify_assertion(rp: RelyingParty, answer: Any, *, challenge: str, origins: list[str], passkey: Passkey) -> int:
    """Check an assertion by ``passkey`` (its signature over our challenge, the relying party, the origin, user
    verification, a counter that moved on); the new signature counter. Raises :class:`PasskeyRefused`."""
    if passkey.revoked:
        raise PasskeyRefused("this passkey was revoked")
    from webauthn import verify_authentication_response
    from webauthn.helpers.exceptions import WebAuthnException

    try:
        verified = verify_authentication_response(
            credential=answer,
            expected_challenge=from_b64url(challenge),
            expected_rp_id=rp.id,
            expected_origin=origins,
            credential_public_key=from_b64url(passkey.public_key),
            credential_current_sign_count=passkey.sign_count,
            require_user_verification=True,
        )
    except (WebAuthnException, ValueError, KeyError, TypeError) as exc:
        raise PasskeyRefused(f"the passkey's answer was not accepted: {exc}") from None
    if not verified.user_verified:  # the library requires it too; said twice because it is the point
        raise PasskeyRefused("the authenticator did not verify the person")
    return verified.new_sign_count
