package deploy

import (
	"fmt"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// wellKnownPorts are ports that common CSI drivers' node plugins and common
// node agents listen on in the host's network namespace, and who does.
// The node plugin runs with hostNetwork, so a port of its pod is a port of
// every node: it must not be one of these.
var wellKnownPorts = map[int32]string{
	9808:  "the livenessprobe sidecar's default (EBS, GCE PD, most CSI drivers)",
	9809:  "node-driver-registrar's usual --http-endpoint (EFS, Linstor, many CSI drivers)",
	9810:  "the FSx CSI driver's livenessprobe",
	9898:  "csi-driver-host-path's livenessprobe",
	3301:  "the EBS CSI driver's controller metrics",
	3302:  "the EBS CSI driver's node metrics",
	29602: "Azure Disk CSI's controller health", 29603: "Azure Disk CSI's node health",
	29604: "Azure Disk CSI's controller metrics", 29605: "Azure Disk CSI's node metrics",
	29612: "Azure File CSI's controller health", 29613: "Azure File CSI's node health",
	29614: "Azure File CSI's controller metrics", 29615: "Azure File CSI's node metrics",
	29643: "the SMB CSI driver's node health",
	29653: "the NFS CSI driver's node health",
	8080:  "ceph-csi's node plugin metrics (rbd)",
	8081:  "ceph-csi's node plugin metrics (cephfs)",
	8680:  "ceph-csi's liveness metrics (rbd)",
	8681:  "ceph-csi's liveness metrics (cephfs)",
	9500:  "OpenEBS LocalPV's node metrics",
	9100:  "node-exporter",
	9099:  "calico-node's health",
	9091:  "Calico Felix's metrics",
	4240:  "cilium-health",
	9879:  "the Cilium agent's health",
	9962:  "the Cilium agent's metrics", 9963: "the Cilium operator's metrics", 9965: "Hubble's metrics",
	10248: "the kubelet's healthz", 10250: "the kubelet's API", 10255: "the kubelet's read-only port",
	10249: "kube-proxy's metrics", 10256: "kube-proxy's healthz",
	10257: "kube-controller-manager", 10259: "kube-scheduler",
	2379: "etcd", 2380: "etcd's peers", 2381: "etcd's metrics", 6443: "kube-apiserver",
}

// Port ranges a host-network listener must stay out of: the NodePort range
// (kube-proxy's on every node) and Linux's default ephemeral ports (an
// outgoing connection may hold the port when the plugin restarts).
const (
	nodePortMin, nodePortMax = 30000, 32767
	ephemeralMin             = 32768
)

// listener is a TCP address a container listens on, from its flags.
type listener struct {
	flag string // the flag that sets it, as "--http-endpoint"
	host string // "" for every address
	port int32
}

func (l listener) loopback() bool {
	return l.host == "127.0.0.1" || l.host == "localhost" || l.host == "[::1]"
}

// listeners returns the addresses a container listens on, from the flags
// that set them: stor-csi --health-listen; a CSI sidecar's --http-endpoint
// and --metrics-address; the livenessprobe's --health-port (0.0.0.0, and
// 9808 when neither it nor --http-endpoint is given).
func listeners(c corev1.Container) ([]listener, error) {
	args := commandLine(c)
	var out []listener
	for _, f := range []string{"health-listen", "http-endpoint", "metrics-address"} {
		v, ok := flagValue(args, f)
		if !ok || v == "" {
			continue
		}
		host, port, err := netSplit(v)
		if err != nil {
			return nil, fmt.Errorf("--%s=%s: %v", f, v, err)
		}
		n, _ := strconv.Atoi(port)
		out = append(out, listener{"--" + f, host, int32(n)})
	}
	if imageName(c.Image) == "livenessprobe" {
		if _, ok := flagValue(args, "http-endpoint"); !ok {
			port := "9808"
			if v, ok := flagValue(args, "health-port"); ok {
				port = v
			}
			n, err := strconv.Atoi(port)
			if err != nil {
				return nil, fmt.Errorf("--health-port=%s: %v", port, err)
			}
			out = append(out, listener{"--health-port", "", int32(n)})
		}
	}
	return out, nil
}

// isNodePlugin: the pod runs stor-csi --mode=node.
func isNodePlugin(p podTemplate) bool {
	d := driverContainer(p)
	if d == nil {
		return false
	}
	_, args, _ := storBinary(*d)
	mode, _ := flagValue(args, "mode")
	return mode == "node"
}

// checkNodeHostNetwork checks the node plugin's pod (issue 14, defect 6):
//
//   - hostNetwork: before Linux 6.3 the nbd netlink family answers only in
//     the host's network namespace; and dnsPolicy ClusterFirstWithHostNet,
//     so that the stor-api Service still resolves;
//   - every port it listens on (its containers' listening flags) is
//     declared by the container that listens, with hostPort equal to
//     containerPort, and no port is declared that nothing listens on;
//   - no two containers use one port; none is a well-known port of another
//     CSI driver or node agent (wellKnownPorts), in the NodePort range or
//     among the ephemeral ports;
//   - a listener on loopback is probed with host 127.0.0.1 (the kubelet
//     otherwise probes the pod's IP, the node's, where nothing answers),
//     and a listener on every address is refused: nothing off the node
//     needs these ports.
func checkNodeHostNetwork(p podTemplate, fail func(string, ...any)) {
	if !isNodePlugin(p) {
		return
	}
	spec := p.spec
	if !spec.HostNetwork {
		fail("%s: the node plugin is not hostNetwork: before Linux 6.3 the nbd netlink family answers only in the host's network namespace", p.owner)
		return
	}
	if spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		fail("%s: dnsPolicy %q with hostNetwork: the stor-api Service does not resolve; want %s", p.owner, spec.DNSPolicy, corev1.DNSClusterFirstWithHostNet)
	}
	owner := map[int32]string{}   // port -> the container that listens on it
	bound := map[int32]listener{} // port -> its listener
	for _, c := range allContainers(spec) {
		ls, err := listeners(c)
		if err != nil {
			fail("%s: container %s: %v", p.owner, c.Name, err)
			continue
		}
		for _, l := range ls {
			if other, ok := owner[l.port]; ok {
				fail("%s: containers %s and %s both listen on port %d", p.owner, other, c.Name, l.port)
				continue
			}
			owner[l.port], bound[l.port] = c.Name, l
			if !l.loopback() {
				fail("%s: container %s: %s listens on %q:%d, every address of the node (hostNetwork); bind 127.0.0.1", p.owner, c.Name, l.flag, l.host, l.port)
			}
			if who, ok := wellKnownPorts[l.port]; ok {
				fail("%s: container %s: port %d is a host port (hostNetwork) and %s", p.owner, c.Name, l.port, who)
			}
			if l.port < 1024 || l.port >= nodePortMin && l.port <= nodePortMax || l.port >= ephemeralMin {
				fail("%s: container %s: port %d is privileged, a NodePort or an ephemeral port; a host port must be none of them", p.owner, c.Name, l.port)
			}
			declared := false
			for _, cp := range c.Ports {
				if cp.ContainerPort == l.port {
					declared = true
					if cp.HostPort != cp.ContainerPort {
						fail("%s: container %s: port %d has hostPort %d; with hostNetwork it is a host port, say so (hostPort %d)", p.owner, c.Name, l.port, cp.HostPort, l.port)
					}
				}
			}
			if !declared {
				fail("%s: container %s listens on port %d (%s) but does not declare it: the scheduler cannot see the host port", p.owner, c.Name, l.port, l.flag)
			}
		}
	}
	for _, c := range allContainers(spec) {
		for _, cp := range c.Ports {
			if owner[cp.ContainerPort] != c.Name {
				fail("%s: container %s declares port %d, on which it does not listen", p.owner, c.Name, cp.ContainerPort)
			}
		}
		for _, pr := range []struct {
			what string
			p    *corev1.Probe
		}{{"livenessProbe", c.LivenessProbe}, {"readinessProbe", c.ReadinessProbe}, {"startupProbe", c.StartupProbe}} {
			if pr.p == nil || pr.p.HTTPGet == nil {
				continue
			}
			port := probePort(c, pr.p.HTTPGet.Port)
			l, ok := bound[port]
			switch {
			case !ok:
				fail("%s: container %s: %s on port %d, on which nothing listens", p.owner, c.Name, pr.what, port)
			case l.loopback() && strings.Trim(pr.p.HTTPGet.Host, "[]") != strings.Trim(l.host, "[]") && !(l.host == "localhost" && pr.p.HTTPGet.Host == "127.0.0.1"):
				fail("%s: container %s: %s on port %d asks host %q; %s listens on %s only (want host: %s)", p.owner, c.Name, pr.what, port, pr.p.HTTPGet.Host, owner[port], l.host, l.host)
			}
		}
	}
}
