"""A rank that probes its own session's defences (no torch): permissions, tokens, listeners.

Prints one ``probe key=value`` line per finding for the test to check.
"""

import os
import socket
import stat

import psutil
import zmq

run_dir = os.environ["MIRAGE_RUN_DIR"]
endpoint = os.environ["MIRAGE_ENDPOINT"]
rpc_path = endpoint.removeprefix("ipc://")


def mode(path):
    return oct(stat.S_IMODE(os.stat(path).st_mode))


print(f"probe run_dir_mode={mode(run_dir)}", flush=True)
print(f"probe ranks_mode={mode(os.path.join(run_dir, 'ranks'))}", flush=True)
print(f"probe token_mode={mode(os.path.join(run_dir, 'token'))}", flush=True)
print(f"probe rpc_in_run_dir={os.path.dirname(rpc_path) == run_dir}", flush=True)

# another user cannot even reach the socket (root can drop to nobody to show it)
if os.getuid() == 0:
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                os.stat(os.path.join(os.path.dirname(run_dir), "."))  # the folder above is open to us...
            except PermissionError:
                os._exit(12)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(rpc_path)
            os._exit(0)
        except PermissionError:
            os._exit(13)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    print(f"probe other_user_connect={ {13: 'EACCES', 12: 'parent-closed', 0: 'connected'}.get(code, code)}", flush=True)

ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(endpoint)
for name, token in (("none", None), ("wrong", "0" * 32), ("right", os.environ["MIRAGE_TOKEN"])):
    body = '{"v":1,"type":"ping","req":7' + ("" if token is None else f',"token":"{token}"') + "}"
    sock.send(body.encode())
    reply = sock.recv().decode() if sock.poll(10_000) else "no reply"
    print(f"probe ping_{name}={reply}", flush=True)
sock.close()

# nothing of the session listens on the network: the daemon and the session speak ipc:// only
me = psutil.Process()
session = os.environ["MIRAGE_SESSION"]
listening = []
for p in psutil.process_iter(["pid"]):
    try:
        if p.pid != me.pid and p.environ().get("MIRAGE_SESSION") == session or p.pid == me.ppid():
            listening += [c for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        continue
print(f"probe inet_listeners={len(listening)}", flush=True)
