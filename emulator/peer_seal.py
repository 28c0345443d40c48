"""Sealing what host daemons send each other: an AEAD from libsodium, one key per direction of each link.

The head's TCP endpoints use ZeroMQ's CURVE. Host daemon to host daemon, where
every byte of an all-reduce across hosts travels twice, CURVE cost more than
the exchange itself: it moved about 0.7 GB/s per core here, where libsodium's
AEGIS-256 seals 6.7 GB/s and opens 4.2 (AES-256-GCM 3.3/3.5, ChaCha20-Poly1305
about 1.9); measured in docs/scaling.md. So a peer link is plain TCP on the
run's interface, and every message on it is sealed here with an authenticated
cipher: as strong as CURVE's (XSalsa20-Poly1305), with 256-bit keys that never
cross the network in clear. libsodium is the one pyzmq ships for CURVE, called
through ctypes: no dependency of its own.

- **Keys.** The head draws a 32-byte run key for each run and sends it with
  the peer directory over the agents' CURVE bus; each agent hands it to its
  daemon over ``ipc://`` in its 0700 directory. Each direction of each link
  seals with its own key, BLAKE2b keyed with the run key over ``"src>dst"``.
- **Nonces.** A message's nonce is its link's counter (and the part of the
  message), so no key ever seals twice under one nonce in a run; a receiver
  takes only counters above the last it took from that host (nothing replayed).
- **A message** is ``[b"<src>\\n<counter>", sealed header, sealed data?]``:
  the clear frame names the sender and counter and is the additional data of
  both sealed parts, which therefore cannot be moved to another message.
  Whoever lacks the run key can neither read a message nor make one that opens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import os

import numpy as np
import zmq

#: Bytes an AEAD adds to what it seals (its tag), at most: 32 for AEGIS-256, 16 for the others.
TAG_BYTES = 32


class SealError(Exception):
    """A message that does not open: not sealed for this host under the run key, replayed, or malformed."""


def _libsodium() -> ctypes.CDLL | None:
    """libsodium: the one pyzmq ships (CURVE's), else the system's."""
    shipped = glob.glob(os.path.join(os.path.dirname(zmq.__file__), os.pardir, "pyzmq.libs", "libsodium*.so*"))
    for path in [*shipped, ctypes.util.find_library("sodium")]:
        if path:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if lib.sodium_init() >= 0:
                return lib
    return None


class Cipher:
    """One libsodium AEAD (``crypto_aead_<name>``): 32-byte keys; its nonce and tag sizes are its own."""

    def __init__(self, lib: ctypes.CDLL, name: str):
        self.name = name
        self.nonce_bytes = getattr(lib, f"crypto_aead_{name}_npubbytes")()
        self.tag_bytes = getattr(lib, f"crypto_aead_{name}_abytes")()
        ptr, size, text = ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_char_p
        self._encrypt = getattr(lib, f"crypto_aead_{name}_encrypt")  # (c, clen_p, m, mlen, ad, adlen, nsec, npub, k)
        self._encrypt.argtypes = [ptr, ctypes.POINTER(size), ptr, size, text, size, ptr, text, text]
        self._decrypt = getattr(lib, f"crypto_aead_{name}_decrypt")  # (m, mlen_p, nsec, c, clen, ad, adlen, npub, k)
        self._decrypt.argtypes = [ptr, ctypes.POINTER(size), ptr, ptr, size, text, size, text, text]
        self._encrypt.restype = self._decrypt.restype = ctypes.c_int

    def seal(self, data, ad: bytes, nonce: bytes, key: bytes) -> np.ndarray:
        """``data`` (any buffer) sealed: its bytes then the tag."""
        src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).reshape(-1)
        # numpy's allocations, not a bytearray's: large ones come in huge pages where the kernel has them, and
        # faulting in a fresh chunk's pages one by one cost as much as sealing it
        out = np.empty(src.nbytes + self.tag_bytes, np.uint8)
        length = ctypes.c_ulonglong()
        self._encrypt(out.ctypes.data, ctypes.byref(length), src.ctypes.data, src.nbytes, ad, len(ad), None, nonce,
                      key)
        return out

    def open(self, sealed, ad: bytes, nonce: bytes, key: bytes, out: np.ndarray | None = None) -> np.ndarray:
        """What ``sealed`` holds (written into ``out``, bytes, if given), or :class:`SealError` if it does not
        open under ``key`` (``out`` then holds nothing of it)."""
        src = np.frombuffer(sealed, np.uint8)
        size = src.nbytes - self.tag_bytes
        if size < 0:
            raise SealError(f"a sealed part of {src.nbytes} bytes")
        if out is None:
            out = np.empty(max(1, size), np.uint8)  # (never empty: ctypes needs an address)
        elif out.nbytes != size or not out.flags.c_contiguous:
            raise SealError(f"{size} bytes sealed for a place of {out.nbytes}")
        length = ctypes.c_ulonglong()
        if self._decrypt(out.ctypes.data, ctypes.byref(length), None, src.ctypes.data, src.nbytes, ad, len(ad),
                         nonce, key) != 0:
            raise SealError("it does not open under the run's key (forged, altered, or not for this host)")
        return out[:size]


def best_cipher() -> Cipher | None:
    """The fastest AEAD this libsodium has here: AEGIS-256 (1.0.19 on), else AES-256-GCM where the CPU has AES
    instructions, else ChaCha20-Poly1305; None without libsodium."""
    lib = _libsodium()
    if lib is None:
        return None
    if hasattr(lib, "crypto_aead_aegis256_encrypt"):
        return Cipher(lib, "aegis256")
    return Cipher(lib, "aes256gcm" if lib.crypto_aead_aes256gcm_is_available() else "chacha20poly1305_ietf")


def keep_freed_buffers() -> None:
    """Have malloc keep freed large buffers for the next ones (glibc): a chunk sealed or opened in fresh pages
    faults each one in, which cost as much as the cipher (1 GB/s against 2-3)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 256 << 20)  # M_MMAP_THRESHOLD: chunks come from the heap, not each from its own mmap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: and the heap keeps them once freed
    except (OSError, AttributeError):  # another libc: buffers as it gives them
        pass


class Sealed:
    """A message's data, still sealed: opened where it is to go (:meth:`open`), so its bytes are written once."""

    def __init__(self, cipher: Cipher, sealed, ad: bytes, nonce: bytes, key: bytes):
        self.cipher, self.sealed, self.ad, self.nonce, self.key = cipher, sealed, ad, nonce, key
        self.nbytes = max(0, len(sealed) - cipher.tag_bytes)

    def open(self, out: np.ndarray | None = None) -> np.ndarray:
        """The bytes (into ``out``, a contiguous uint8 view of ``nbytes``, if given); :class:`SealError` if they do
        not open."""
        return self.cipher.open(self.sealed, self.ad, self.nonce, self.key, out)


def _nonce(counter: int, part: int, size: int) -> bytes:
    return (counter.to_bytes(8, "big") + part.to_bytes(4, "big")).rjust(size, b"\0")


class Seals:
    """This host's seals: the keys of its links both ways, their counters, the cipher they use."""

    def __init__(self, cipher: Cipher, host: str, run_key: bytes):
        self.cipher = cipher
        self.host = host
        self.run_key = run_key
        self._keys: dict[str, bytes] = {}  # "src>dst" -> its key
        self._sent: dict[str, int] = {}  # host -> counter of the last message sent to it
        self._taken: dict[str, int] = {}  # host -> counter of the last message taken from it

    def _key(self, src: str, dst: str) -> bytes:
        name = f"{src}>{dst}"
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = hashlib.blake2b(name.encode(), key=self.run_key, digest_size=32).digest()
        return key

    def seal(self, dst: str, header: bytes, data=None) -> list:
        """The frames of a message to ``dst``: the clear frame, the sealed header, the sealed data (if any)."""
        counter = self._sent[dst] = self._sent.get(dst, 0) + 1
        clear = f"{self.host}\n{counter}".encode()
        key = self._key(self.host, dst)
        size = self.cipher.nonce_bytes
        frames = [clear, self.cipher.seal(header, clear, _nonce(counter, 0, size), key)]
        if data is not None:
            frames.append(self.cipher.seal(data, clear, _nonce(counter, 1, size), key))
        return frames

    def open(self, frames: list) -> tuple[str, np.ndarray, Sealed | None]:
        """(sender, header, its data still sealed or None) of a message's frames; :class:`SealError` unless the
        header opens (the data is checked as it is opened)."""
        if len(frames) not in (2, 3):
            raise SealError(f"{len(frames)} frames")
        clear = bytes(frames[0])
        try:
            src, counter_text = clear.decode().split("\n")
            counter = int(counter_text)
        except (UnicodeDecodeError, ValueError):
            raise SealError("no sender and counter in clear") from None
        if src == self.host or len(src) > 255:
            raise SealError(f"a message claiming to be from {src[:64]!r}")
        key, size = self._key(src, self.host), self.cipher.nonce_bytes
        header = self.cipher.open(frames[1], clear, _nonce(counter, 0, size), key)
        data = Sealed(self.cipher, frames[2], clear, _nonce(counter, 1, size), key) if len(frames) == 3 else None
        if counter <= self._taken.get(src, 0):  # checked once it opened: a forger cannot move a host's counter
            raise SealError(f"message {counter} from {src} replayed")
        self._taken[src] = counter
        return src, header, data
