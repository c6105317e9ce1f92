"""A local HTTP server answering the Kubernetes API's pod list and get, in their real JSON shapes.

The one fake the tests allow for Kubernetes: there is no API server here. It serves
GET /api/v1/pods?fieldSelector=spec.nodeName=<node> (a PodList) and
GET /api/v1/namespaces/<ns>/pods/<name> (a Pod, or a 404 Status), records every request, and can
answer with an error status or stop answering at all.
"""
from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


def pod(name: str, namespace: str = "default", node: str = "gpu-node-1", uid: str | None = None,
        containers: dict[str, str] | None = None, labels: dict | None = None, annotations: dict | None = None,
        ip: str = "10.244.1.17", phase: str = "Running", runtime: str = "containerd") -> dict:
    """A Pod as the API server returns it; `containers` maps container name -> 64-hex container id."""
    uid = uid or str(uuid.uuid4())
    containers = containers or {}
    started = "2026-11-30T09:12:44Z"
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {
            "name": name, "namespace": namespace, "uid": uid, "resourceVersion": "482913",
            "creationTimestamp": started, "labels": labels or {"app.kubernetes.io/name": name},
            "annotations": annotations or {},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{name}-7d9c6b5f4",
                                 "uid": str(uuid.uuid4()), "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            "nodeName": node, "restartPolicy": "Always", "serviceAccountName": "default",
            "containers": [{"name": c, "image": f"registry.example/{c}:1.0", "resources": {},
                            "terminationMessagePath": "/dev/termination-log",
                            "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}
                           for c in containers],
        },
        "status": {
            "phase": phase, "hostIP": "192.0.2.10", "hostIPs": [{"ip": "192.0.2.10"}],
            "podIP": ip if phase == "Running" else None, "podIPs": [{"ip": ip}] if phase == "Running" else [],
            "startTime": started, "qosClass": "Burstable",
            "conditions": [{"type": "Ready", "status": "True" if phase == "Running" else "False",
                            "lastProbeTime": None, "lastTransitionTime": started}],
            "containerStatuses": [{
                "name": c, "containerID": f"{runtime}://{cid}", "image": f"registry.example/{c}:1.0",
                "imageID": f"registry.example/{c}@sha256:{'ab' * 32}", "ready": True, "restartCount": 0,
                "started": True, "state": {"running": {"startedAt": started}}, "lastState": {},
            } for c, cid in containers.items()] if phase == "Running" else [],
        },
    }


def not_found(name: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f'pods "{name}" not found', "reason": "NotFound",
            "details": {"name": name, "kind": "pods"}, "code": 404}


class KubeAPI:
    """The fake API server: `pods` is what it serves; `requests` what it was asked."""

    def __init__(self):
        self.pods: list[dict] = []
        self.requests: list[str] = []
        self.fail_with: int | None = None  # answer every request with this status
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The API goes down: connections are refused from now on."""
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                url = urlsplit(self.path)
                api.requests.append(self.path)
                if api.fail_with is not None:
                    return self._send(api.fail_with, {
                        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": "etcdserver: request timed out", "reason": "InternalError",
                        "code": api.fail_with})
                parts = url.path.strip("/").split("/")
                if parts == ["api", "v1", "pods"]:
                    selector = parse_qs(url.query).get("fieldSelector", [""])[0]
                    node = selector.removeprefix("spec.nodeName=") if selector else None
                    items = [p for p in api.pods if node is None or p["spec"]["nodeName"] == node]
                    return self._send(200, {"kind": "PodList", "apiVersion": "v1",
                                            "metadata": {"resourceVersion": "482990"}, "items": items})
                if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
                    namespace, name = parts[3], parts[5]
                    for p in api.pods:
                        if (p["metadata"]["namespace"], p["metadata"]["name"]) == (namespace, name):
                            return self._send(200, p)
                    return self._send(404, not_found(name))
                return self._send(404, not_found(url.path))

            def _send(self, status: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


class Clock:
    """Time the test moves by hand: cache ages without waiting."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

