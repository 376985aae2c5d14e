"""Files and batch jobs of the Batch API, kept in SQLite (WAL) next to the file bodies.

`BatchStore(root)` keeps `root/batch.db` (tables `files` and `batches`) and the bodies under
`root/files/` (uploads) and `root/batches/<id>/` (a job's output and error lines, written as
they finish). A batch row holds its whole OpenAI object as JSON plus the columns queries need.
Every object has an `owner` (a digest of the API key that created it; "" without keys) and is
invisible to other owners. One connection, used from the event loop only (every call is a
few milliseconds of local SQLite); commits are per change, so a SIGKILL loses nothing
committed.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL_STATUSES = ("failed", "completed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    owner TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    path TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
"""


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        (self.root / "batches").mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.root / "batch.db", isolation_level=None,
                                  check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    # files
    def upload_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def job_dir(self, batch_id: str) -> Path:
        path = self.root / "batches" / batch_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def add_file(self, file_id: str, owner: str, purpose: str, filename: str, path: Path
                 ) -> dict[str, Any]:
        size = path.stat().st_size
        self.db.execute("INSERT INTO files (id, owner, purpose, filename, bytes, created_at, "
                        "path) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (file_id, owner, purpose, filename, size, int(time.time()), str(path)))
        file = self.get_file(file_id, owner)
        assert file is not None
        return file

    def get_file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND owner = ?",
                              (file_id, owner)).fetchone()
        return None if row is None else _file_object(row)

    def file_path(self, file_id: str, owner: str) -> Path | None:
        row = self.db.execute("SELECT path FROM files WHERE id = ? AND owner = ?",
                              (file_id, owner)).fetchone()
        return None if row is None else Path(row["path"])

    def delete_file(self, file_id: str, owner: str) -> bool:
        path = self.file_path(file_id, owner)
        if path is None:
            return False
        self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        path.unlink(missing_ok=True)
        return True

    def file_in_use(self, file_id: str) -> bool:
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        row = self.db.execute(f"SELECT 1 FROM batches WHERE input_file_id = ? AND status IN "
                              f"({marks})", (file_id, *ACTIVE_STATUSES)).fetchone()
        return row is not None

    # batches
    def add_batch(self, batch: dict[str, Any], owner: str) -> None:
        self.db.execute("INSERT INTO batches (id, owner, status, input_file_id, data) VALUES "
                        "(?, ?, ?, ?, ?)", (batch["id"], owner, batch["status"],
                                            batch["input_file_id"], json.dumps(batch)))

    def save_batch(self, batch: dict[str, Any]) -> None:
        self.db.execute("UPDATE batches SET status = ?, data = ? WHERE id = ?",
                        (batch["status"], json.dumps(batch), batch["id"]))

    def get_batch(self, batch_id: str, owner: str | None) -> dict[str, Any] | None:
        """The batch (any owner's with `owner=None`)."""
        if owner is None:
            row = self.db.execute("SELECT data FROM batches WHERE id = ?",
                                  (batch_id,)).fetchone()
        else:
            row = self.db.execute("SELECT data FROM batches WHERE id = ? AND owner = ?",
                                  (batch_id, owner)).fetchone()
        return None if row is None else json.loads(row["data"])

    def owner_of(self, batch_id: str) -> str:
        row = self.db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return str(row["owner"])

    def list_batches(self, owner: str, after: str | None, limit: int
                     ) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, those created before batch `after`; (page, has_more)."""
        rows = self._page("batches", "data", owner, after, limit)
        page = [json.loads(row["data"]) for row in rows]
        return page[:limit], len(page) > limit

    def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int
                   ) -> tuple[list[dict[str, Any]], bool]:
        """Newest first (of `purpose` when given), those uploaded before file `after`."""
        rows = self._page("files", "*", owner, after, limit, purpose)
        page = [_file_object(row) for row in rows]
        return page[:limit], len(page) > limit

    def _page(self, table: str, columns: str, owner: str, after: str | None, limit: int,
              purpose: str | None = None) -> list[sqlite3.Row]:
        where, args = ["owner = ?"], [owner]
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            where.append(f"seq < (SELECT seq FROM {table} WHERE id = ?)")
            args.append(after)
        return self.db.execute(f"SELECT {columns} FROM {table} WHERE {' AND '.join(where)} "
                               "ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()

    def active_batches(self) -> list[dict[str, Any]]:
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        rows = self.db.execute(f"SELECT data FROM batches WHERE status IN ({marks}) ORDER BY "
                               "seq", ACTIVE_STATUSES).fetchall()
        return [json.loads(row["data"]) for row in rows]


def _file_object(row: sqlite3.Row) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "expires_at": None}
