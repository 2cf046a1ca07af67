package deploy

import (
	"path"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// minRecoveryBudget is the least time the node plugin's startupProbe must
// give recovery (failureThreshold x periodSeconds): reopening every staged
// volume after a restart goes through the cluster, which may be electing
// a leader at the time.
const minRecoveryBudget = 300 // seconds

// probePort resolves a probe's port (a number or a name of one of c's
// ports) to a number; 0 if it names no port of c.
func probePort(c corev1.Container, p intstr.IntOrString) int32 {
	if p.Type == intstr.Int {
		return p.IntVal
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return cp.ContainerPort
		}
	}
	return 0
}

// checkCSIProbes checks the stor-csi container's probes against what the
// binary serves (issue 14, defect 7):
//
//   - --health-listen serves /healthz and /readyz; the readinessProbe is
//     /readyz on that port (readiness gates on the cluster and recovery);
//   - the livenessProbe never asks /readyz (a leaderless cluster or a
//     recovery in progress must not restart the container): it is the
//     livenessprobe sidecar (CSI Probe, local) or stor-csi's /healthz;
//   - the node plugin has a startupProbe on /readyz whose budget covers
//     recovery (minRecoveryBudget).
func checkCSIProbes(p podTemplate, fail func(string, ...any)) {
	driver := driverContainer(p)
	if driver == nil {
		return
	}
	_, args, _ := storBinary(*driver)
	listen, ok := flagValue(args, "health-listen")
	if !ok {
		fail("%s: stor-csi has no --health-listen: nothing serves /readyz", p.owner)
		return
	}
	_, port, err := netSplit(listen)
	healthPort, _ := strconv.Atoi(port)
	if err != nil {
		fail("%s: stor-csi --health-listen=%s: %v", p.owner, listen, err)
		return
	}
	// The livenessprobe sidecar's port, if there is one.
	sidecarPort := int32(0)
	for _, c := range p.spec.Containers {
		if imageName(c.Image) == "livenessprobe" {
			ls, _ := listeners(c) // a bad flag is checkNodeHostNetwork's to report
			for _, l := range ls {
				if l.flag == "--http-endpoint" || l.flag == "--health-port" {
					sidecarPort = l.port
				}
			}
		}
	}
	readyz := func(what string, pr *corev1.Probe) bool {
		if pr == nil || pr.HTTPGet == nil {
			fail("%s: stor-csi has no HTTP %s", p.owner, what)
			return false
		}
		if got := probePort(*driver, pr.HTTPGet.Port); pr.HTTPGet.Path != "/readyz" || got != int32(healthPort) {
			fail("%s: stor-csi %s asks %s on port %d, want /readyz on --health-listen's %d", p.owner, what, pr.HTTPGet.Path, got, healthPort)
			return false
		}
		return true
	}
	readyz("readinessProbe", driver.ReadinessProbe)
	if lp := driver.LivenessProbe; lp != nil && lp.HTTPGet != nil {
		got := probePort(*driver, lp.HTTPGet.Port)
		switch {
		case lp.HTTPGet.Path == "/readyz":
			fail("%s: stor-csi livenessProbe asks /readyz: a leaderless cluster or a recovery in progress would restart it", p.owner)
		case got == int32(healthPort) && lp.HTTPGet.Path == "/healthz":
		case got == sidecarPort && sidecarPort != 0 && lp.HTTPGet.Path == "/healthz":
		default:
			fail("%s: stor-csi livenessProbe asks %s on port %d: neither stor-csi's /healthz (%d) nor the livenessprobe sidecar (%d)", p.owner, lp.HTTPGet.Path, got, healthPort, sidecarPort)
		}
	}
	if mode, _ := flagValue(args, "mode"); mode == "node" {
		sp := driver.StartupProbe
		if readyz("startupProbe", sp) {
			if budget := sp.FailureThreshold * max(sp.PeriodSeconds, 1); budget < minRecoveryBudget {
				fail("%s: stor-csi startupProbe gives recovery %ds (%d x %ds), want at least %ds", p.owner, budget, sp.FailureThreshold, sp.PeriodSeconds, minRecoveryBudget)
			}
		}
	}
}

// imageName is an image reference's last path element without tag or
// digest: "livenessprobe" for registry.k8s.io/sig-storage/livenessprobe:v2.17.0.
func imageName(image string) string {
	image, _, _ = strings.Cut(image, "@")
	name, _, _ := strings.Cut(path.Base(image), ":")
	return name
}

// nodeOnlyFlags are stor-csi's node flags, which --mode=controller refuses
// (csi.Config.Validate): the controller must not be given them.
var nodeOnlyFlags = []string{"node-id", "zone", "state-dir", "max-volumes"}

// checkCSIModeFlags: a stor-csi container in controller mode is given no
// node-only flag (it would refuse to start).
func checkCSIModeFlags(p podTemplate, fail func(string, ...any)) {
	for _, c := range p.spec.Containers {
		bin, args, ok := storBinary(c)
		if !ok || bin != "stor-csi" {
			continue
		}
		if mode, _ := flagValue(args, "mode"); mode != "controller" {
			continue
		}
		for _, f := range nodeOnlyFlags {
			if v, ok := flagValue(args, f); ok {
				fail("%s: container %s: stor-csi --mode=controller is given --%s=%s, a node flag it refuses", p.owner, c.Name, f, v)
			}
		}
	}
}

// checkNodeMemory: the node plugin's stor-csi container serves the
// kernel's writeback to its devices, so its memory is reserved (request
// = limit, both set) and its CPU is not capped (a throttled NBD server
// stalls every volume of the node).
func checkNodeMemory(p podTemplate, fail func(string, ...any)) {
	for _, c := range p.spec.Containers {
		bin, args, ok := storBinary(c)
		if !ok || bin != "stor-csi" {
			continue
		}
		if mode, _ := flagValue(args, "mode"); mode != "node" {
			continue
		}
		req, hasReq := c.Resources.Requests[corev1.ResourceMemory]
		lim, hasLim := c.Resources.Limits[corev1.ResourceMemory]
		if !hasReq || !hasLim || req.Cmp(lim) != 0 {
			fail("%s: container %s: memory request %s, limit %s: the node plugin serves its node's writeback, want both set and equal", p.owner, c.Name, req.String(), lim.String())
		}
		if cpu, ok := c.Resources.Limits[corev1.ResourceCPU]; ok {
			fail("%s: container %s: CPU limit %s: a throttled NBD server stalls every volume of the node", p.owner, c.Name, cpu.String())
		}
	}
}

// storImages are the images built from deploy/images, and placeholderTag
// the tag make images gives them and the base's kustomization names:
// nothing publishes them, so a reference must be an obvious local
// placeholder (docs/INSTALL.md says which line to change), never a
// registry that does not have them.
var storImages = []string{"stor-server", "stor-csi"}

const placeholderTag = "dev"

// checkStorImages: every stor image reference is the placeholder
// <name>:dev.
func checkStorImages(p podTemplate, fail func(string, ...any)) {
	for _, c := range allContainers(p.spec) {
		name := imageName(c.Image)
		if !slices.Contains(storImages, name) {
			continue
		}
		if want := name + ":" + placeholderTag; c.Image != want {
			fail("%s: container %s: image %s, want the placeholder %s (nothing publishes stor images; docs/INSTALL.md says how to point it at yours)", p.owner, c.Name, c.Image, want)
		}
	}
}
