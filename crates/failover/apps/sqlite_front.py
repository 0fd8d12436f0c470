# SQLite behind a small network front: the crash-consistent application of Understudy's
# failover tests. One line per request over TCP:
#   PING          -> "PONG <rows>"       (a read-only query: the health check)
#   INSERT <id>   -> "OK <id>"           (acknowledged only after the commit is durable)
#   LIST          -> "IDS <id>,<id>,..."
#   COUNT         -> "COUNT <rows>"
#   FILL <n> <b>  -> "FILLED <n>"        (n rows of b bytes in one transaction: WAL to recover)
#   CHECKPOINT    -> "CHECKPOINTED"      (the WAL copied into the database and truncated)
# WAL mode with synchronous=FULL: a commit is fsynced before it is acknowledged. The optional
# housekeeping thread writes on its own (like log rotation or GC), reachable or not.
import argparse, signal, socketserver, sqlite3, sys, threading, time

t_start = time.time()  # the interpreter is up (a bench reads these times from the log)

ap = argparse.ArgumentParser()
ap.add_argument("--db", required=True)
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--housekeeping-ms", type=int, default=0)
ap.add_argument("--payload-bytes", type=int, default=200)
# Pages of WAL before an automatic checkpoint (SQLite's default 1000; 0: never): how much WAL a
# crash can leave for recovery.
ap.add_argument("--wal-autocheckpoint-pages", type=int, default=1000)
# A file holding a number of milliseconds to spend after the database is open (SQLite's own
# recovery done) and before serving: a recovery of that length (benchmarks set it per failure,
# as Figure 6 of SpecREDS varies recovery length). Missing or empty: none.
ap.add_argument("--startup-delay-file", default="")
args = ap.parse_args()

t0 = time.time()
db = sqlite3.connect(args.db, isolation_level=None, check_same_thread=False)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=FULL")
db.execute(f"PRAGMA wal_autocheckpoint={int(args.wal_autocheckpoint_pages)}")
db.execute("CREATE TABLE IF NOT EXISTS commits(id INTEGER PRIMARY KEY, payload BLOB)")
db.execute("CREATE TABLE IF NOT EXISTS housekeeping(at REAL)")
db.execute("CREATE TABLE IF NOT EXISTS fill(payload BLOB)")
rows = db.execute("SELECT count(*) FROM commits").fetchone()[0]
t_open = time.time()
print(f"sqlite front: {args.db} open with {rows} rows in {t_open - t0:.3f} s (started_unix {t_start:.4f} opened_unix {t_open:.4f})", flush=True)
if args.startup_delay_file:
    try:
        with open(args.startup_delay_file) as f:
            delay_ms = int(f.read().strip() or "0")
    except (OSError, ValueError):
        delay_ms = 0
    if delay_ms > 0:
        print(f"sqlite front: recovering for {delay_ms} ms more", flush=True)
        time.sleep(delay_ms / 1000.0)
lock = threading.Lock()
payload = b"x" * args.payload_bytes


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        for raw in self.rfile:
            words = raw.decode("utf-8", "replace").split()
            if not words:
                continue
            cmd = words[0].upper()
            try:
                with lock:
                    if cmd == "PING":
                        n = db.execute("SELECT count(*) FROM commits").fetchone()[0]
                        reply = f"PONG {n}"
                    elif cmd == "INSERT" and len(words) == 2:
                        db.execute("INSERT INTO commits VALUES(?, ?)", (int(words[1]), payload))
                        reply = f"OK {words[1]}"
                    elif cmd == "FILL" and len(words) == 3:
                        n, b = min(int(words[1]), 1_000_000), min(int(words[2]), 1 << 20)
                        db.execute("BEGIN")
                        db.executemany("INSERT INTO fill VALUES(?)", ((b"f" * b,) for _ in range(n)))
                        db.execute("COMMIT")
                        reply = f"FILLED {n}"
                    elif cmd == "CHECKPOINT":
                        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                        reply = "CHECKPOINTED"
                    elif cmd == "LIST":
                        ids = [str(r[0]) for r in db.execute("SELECT id FROM commits ORDER BY id")]
                        reply = "IDS " + ",".join(ids)
                    elif cmd == "COUNT":
                        reply = f"COUNT {db.execute('SELECT count(*) FROM commits').fetchone()[0]}"
                    else:
                        reply = "ERR unknown request"
            except sqlite3.IntegrityError:
                reply = "ERR duplicate id"
            except sqlite3.Error as e:
                # A failed write (EPERM from a fenced volume) ends the process: never acknowledge.
                print(f"sqlite error: {e}", flush=True)
                sys.stdout.flush()
                import os
                os._exit(3)
            self.wfile.write((reply + "\n").encode())


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def housekeeping():
    while True:
        time.sleep(args.housekeeping_ms / 1000.0)
        try:
            with lock:
                db.execute("INSERT INTO housekeeping VALUES(?)", (time.time(),))
                db.execute("DELETE FROM housekeeping WHERE at < ?", (time.time() - 60,))
        except sqlite3.Error as e:
            print(f"housekeeping: {e}", flush=True)
            import os
            os._exit(3)


server = Server((args.host, args.port), Handler)


def stop(signum, frame):
    threading.Thread(target=server.shutdown, daemon=True).start()


signal.signal(signal.SIGTERM, stop)
if args.housekeeping_ms > 0:
    threading.Thread(target=housekeeping, daemon=True).start()
print(f"sqlite front: serving on {args.host}:{args.port} (serving_unix {time.time():.4f})", flush=True)
server.serve_forever()
with lock:
    db.close()
print("sqlite front: stopped cleanly", flush=True)
