#!/usr/bin/env python3
"""Decrypt or encrypt a LUKS data segment with an independent AES-XTS (Python's
`cryptography`, i.e. OpenSSL), for the LUKS tests: what vublk wrote must decrypt with the
volume key cryptsetup dumps, in dm-crypt's numbering (the plain64 IV of each sector is its
offset in the segment in 512-byte units, plus iv_tweak; one XTS data unit per sector).

usage: xts.py decrypt|encrypt IMAGE HEXKEY DATA_OFFSET SECTOR_SIZE IV_TWEAK LENGTH FILE
  decrypt: LENGTH bytes of the segment -> FILE;  encrypt: FILE -> the segment's start.
"""
import sys

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes


def main():
    op, image, hexkey, off, sector, tweak, length, path = sys.argv[1:9]
    key = bytes.fromhex(hexkey)
    off, sector, tweak, length = int(off), int(sector), int(tweak), int(length)
    with open(image, "r+b") as f:
        if op == "decrypt":
            f.seek(off)
            data = f.read(length)
        else:
            data = open(path, "rb").read()
        out = bytearray()
        for i in range(0, len(data), sector):
            iv = (i // 512 + tweak).to_bytes(16, "little")
            c = Cipher(algorithms.AES(key), modes.XTS(iv))
            x = c.decryptor() if op == "decrypt" else c.encryptor()
            out += x.update(data[i:i + sector]) + x.finalize()
        if op == "decrypt":
            open(path, "wb").write(out)
        else:
            f.seek(off)
            f.write(out)


if __name__ == "__main__":
    main()
