package deploy

import (
	"errors"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// kustomizations are the directories kubectl apply -k takes, relative to
// this package.
var kustomizations = []string{
	"kubernetes/base",
	"kubernetes/overlays/multi-zone",
	"kubernetes/overlays/hostpath-data",
}

// examplesDir holds plain manifests, applied with kubectl apply -f.
const examplesDir = "kubernetes/examples"

// binaryFlags returns the flags of the binaries the manifests run, read
// from their sources.
func binaryFlags(t testing.TB) map[string][]string {
	t.Helper()
	flags := map[string][]string{}
	for _, bin := range []string{"stor-server", "stor-csi"} {
		f, err := flagsInSource("../cmd/" + bin)
		if err != nil {
			t.Fatal(err)
		}
		flags[bin] = f
	}
	return flags
}

// validate renders the kustomization dir in fsys, decodes every object
// strictly and checks the cross-references. It returns the objects and
// every problem found.
func validate(fsys filesys.FileSystem, dir string, flags map[string][]string) ([]object, []error) {
	docs, err := render(fsys, dir)
	if err != nil {
		return nil, []error{err}
	}
	dec, err := strictDecoder()
	if err != nil {
		return nil, []error{err}
	}
	objs, errs := decodeAll(dec, dir, docs)
	if len(errs) > 0 {
		return objs, errs
	}
	return objs, crossCheck(objs, flags)
}

// validateExamples decodes every example strictly and checks it against
// the base's classes.
func validateExamples(fsys filesys.FileSystem, dir string, base []object) ([]object, []error) {
	dec, err := strictDecoder()
	if err != nil {
		return nil, []error{err}
	}
	files, err := fsys.Glob(path.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		return nil, []error{errors.Join(errors.New("no examples in "+dir), err)}
	}
	var objs []object
	var errs []error
	for _, f := range files {
		data, err := fsys.ReadFile(f)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		docs, err := splitYAML(data)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		o, e := decodeAll(dec, f, docs)
		objs, errs = append(objs, o...), append(errs, e...)
	}
	if len(errs) > 0 {
		return objs, errs
	}
	return objs, checkExamples(objs, base)
}

func reportAll(t *testing.T, errs []error) {
	t.Helper()
	for _, err := range errs {
		t.Error(err)
	}
}

func kinds(objs []object) map[string]int {
	n := map[string]int{}
	for _, o := range objs {
		n[o.gvk.Kind]++
	}
	return n
}

func TestKustomizationsRenderStrictlyAndCrossCheck(t *testing.T) {
	flags := binaryFlags(t)
	disk := filesys.MakeFsOnDisk()
	for _, dir := range kustomizations {
		t.Run(path.Base(dir), func(t *testing.T) {
			objs, errs := validate(disk, dir, flags)
			reportAll(t, errs)
			n := kinds(objs)
			t.Logf("%s: %d objects %v", dir, len(objs), n)
			for kind, want := range map[string]int{
				"Namespace": 1, "StatefulSet": 1, "Deployment": 1, "DaemonSet": 1, "CSIDriver": 1,
				"StorageClass": 1, "VolumeSnapshotClass": 1, "ServiceAccount": 3, "Service": 2,
				"PodDisruptionBudget": 1, "ClusterRole": 6, "ClusterRoleBinding": 6, "Role": 4, "RoleBinding": 4,
				"Issuer": 2, "Certificate": 4, "NetworkPolicy": 1,
			} {
				if n[kind] != want {
					t.Errorf("%d %s objects, want %d", n[kind], kind, want)
				}
			}
			for _, o := range objs {
				if ns := metaOf(o.obj).ns; ns != "" && ns != "stor-system" {
					t.Errorf("%s is in namespace %q, want stor-system", o.name(), ns)
				}
			}
		})
	}
}

// statefulSet returns the stor-server StatefulSet of objs.
func statefulSet(t *testing.T, objs []object) *appsv1.StatefulSet {
	t.Helper()
	for _, o := range objs {
		if s, ok := o.obj.(*appsv1.StatefulSet); ok && s.Name == serverStatefulSet {
			return s
		}
	}
	t.Fatalf("no StatefulSet %s", serverStatefulSet)
	return nil
}

// TestOverlaysChangeWhatTheySay checks what each overlay is for, on the
// rendered objects.
func TestOverlaysChangeWhatTheySay(t *testing.T) {
	flags := binaryFlags(t)
	disk := filesys.MakeFsOnDisk()
	render := func(dir string) *appsv1.StatefulSet {
		objs, errs := validate(disk, dir, flags)
		reportAll(t, errs)
		return statefulSet(t, objs)
	}
	base := render("kubernetes/base")
	if *base.Spec.Replicas != 3 || len(base.Spec.VolumeClaimTemplates) != 1 {
		t.Errorf("base: %d replicas, %d claim templates; want 3 and the data disk", *base.Spec.Replicas, len(base.Spec.VolumeClaimTemplates))
	}
	if base.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
		t.Errorf("base: podManagementPolicy %q: a fully stopped cluster needs every pod started to regain quorum", base.Spec.PodManagementPolicy)
	}

	mz := render("kubernetes/overlays/multi-zone")
	tsc := mz.Spec.Template.Spec.TopologySpreadConstraints
	if *mz.Spec.Replicas != 5 || len(tsc) != 1 || tsc[0].WhenUnsatisfiable != corev1.DoNotSchedule || tsc[0].TopologyKey != corev1.LabelTopologyZone {
		t.Errorf("multi-zone: %d replicas, spread %+v; want 5 and a hard zone spread", *mz.Spec.Replicas, tsc)
	}

	hp := render("kubernetes/overlays/hostpath-data")
	v, ok := volumeNamed(&hp.Spec.Template.Spec, "data")
	if len(hp.Spec.VolumeClaimTemplates) != 0 || !ok || v.HostPath == nil {
		t.Errorf("hostpath-data: claim templates %d, data volume %+v; want a hostPath instead of a claim", len(hp.Spec.VolumeClaimTemplates), v)
	}
}

func TestExamplesDecodeStrictlyAndUseTheBase(t *testing.T) {
	disk := filesys.MakeFsOnDisk()
	base, errs := validate(disk, "kubernetes/base", binaryFlags(t))
	reportAll(t, errs)
	objs, errs := validateExamples(disk, examplesDir, base)
	reportAll(t, errs)
	var block, restore bool
	for _, o := range objs {
		if c, ok := o.obj.(*corev1.PersistentVolumeClaim); ok {
			block = block || (c.Spec.VolumeMode != nil && *c.Spec.VolumeMode == corev1.PersistentVolumeBlock)
			restore = restore || (c.Spec.DataSource != nil && c.Spec.DataSource.Kind == "VolumeSnapshot")
		}
	}
	if n := kinds(objs); n["VolumeSnapshot"] != 1 || !block || !restore || n["Pod"] != 3 {
		t.Errorf("examples %v (block claim %v, restore %v): want a PVC and pod, a snapshot and restore, a raw block PVC", n, block, restore)
	}
}

// TestSidecarVersions pins the sidecar images issue 7 asks for.
func TestSidecarVersions(t *testing.T) {
	objs, errs := validate(filesys.MakeFsOnDisk(), "kubernetes/base", binaryFlags(t))
	reportAll(t, errs)
	want := map[string]string{
		"csi-provisioner":           "v6.4.0",
		"csi-attacher":              "v4.13.0",
		"csi-resizer":               "v2.3.0",
		"csi-snapshotter":           "v8.7.0",
		"csi-node-driver-registrar": "v2.17.0",
		"livenessprobe":             "v2.17.0",
	}
	seen := map[string]bool{}
	for _, p := range podTemplates(objs) {
		for _, c := range allContainers(p.spec) {
			repo, tag, _ := strings.Cut(c.Image, ":")
			name := path.Base(repo)
			if v, ok := want[name]; ok {
				seen[name] = true
				if !strings.HasPrefix(repo, "registry.k8s.io/sig-storage/") || tag != v {
					t.Errorf("%s: container %s image %s, want registry.k8s.io/sig-storage/%s:%s", p.owner, c.Name, c.Image, name, v)
				}
			}
		}
	}
	for name := range want {
		if !seen[name] {
			t.Errorf("no %s sidecar", name)
		}
	}
}

// copyToMemory copies this package's kubernetes/ tree into an in-memory
// filesystem, so a test can break a copy without touching the real files.
func copyToMemory(t *testing.T) filesys.FileSystem {
	t.Helper()
	mem := filesys.MakeFsInMemory()
	err := filepath.WalkDir("kubernetes", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return mem.WriteFile("/"+filepath.ToSlash(p), data)
	})
	if err != nil {
		t.Fatal(err)
	}
	return mem
}

// TestBrokenManifestsAreCaught breaks a copy of the manifests in one place
// at a time and asserts the validation reports exactly that, and nothing
// else.
func TestBrokenManifestsAreCaught(t *testing.T) {
	flags := binaryFlags(t)
	clean := copyToMemory(t)
	for _, dir := range kustomizations {
		if _, errs := validate(clean, "/"+dir, flags); len(errs) > 0 {
			t.Fatalf("the unbroken copy of %s fails: %v", dir, errs)
		}
	}

	cases := []struct {
		name     string
		file     string // under kubernetes/
		old, new string // every occurrence of old is replaced
		render   string // the kustomization or, for examples, the examples dir
		want     string // in the only error reported
		count    int    // errors expected when not 1
	}{
		{"misspelled StatefulSet field", "base/stor-server.yaml",
			"terminationGracePeriodSeconds:", "terminationGracePeriodSecond:", "base",
			`unknown field "spec.template.spec.terminationGracePeriodSecond"`, 0},
		{"misspelled Certificate field", "base/tls.yaml",
			"  secretName: stor-csi-controller-tls", "  secretNam: stor-csi-controller-tls", "base",
			`unknown field "spec.secretNam"`, 0},
		{"Certificate from a missing Issuer", "base/tls.yaml",
			"    name: stor-selfsigned\n", "    name: stor-self-signed\n", "base",
			`issuerRef Issuer "stor-self-signed" is not an Issuer`, 0},
		{"pod mounts a Secret no Certificate makes", "base/csi-controller.yaml",
			"secretName: stor-csi-controller-tls", "secretName: stor-csi-controller-cert", "base",
			`Secret "stor-csi-controller-cert" is made by no Certificate`, 0},
		{"misspelled CSIDriver field", "base/csidriver.yaml",
			"attachRequired: true", "attachRequred: true", "base",
			`unknown field "spec.attachRequred"`, 0},
		{"misspelled VolumeSnapshotClass field", "base/volumesnapshotclass.yaml",
			"deletionPolicy: Delete", "deletionPolicyy: Delete", "base",
			`unknown field "deletionPolicyy"`, 0},
		{"misspelled mount propagation", "base/csi-node.yaml",
			"mountPropagation: Bidirectional", "mountPropogation: Bidirectional", "base",
			`unknown field "spec.template.spec.containers[0].volumeMounts[1].mountPropogation"`, 0},
		{"unknown kind", "base/csidriver.yaml",
			"kind: CSIDriver", "kind: CSIDrivers", "base",
			`no kind "CSIDrivers" is registered`, 0},
		{"misspelled field in an overlay patch", "overlays/multi-zone/kustomization.yaml",
			"/minDomains", "/minDomain", "overlays/multi-zone",
			`unknown field "spec.template.spec.topologySpreadConstraints[0].minDomain"`, 0},
		{"StorageClass provisioner is not the driver", "base/storageclass.yaml",
			"provisioner: csi.stor.io", "provisioner: csi.stor.com", "base",
			`StorageClass stor: provisioner "csi.stor.com" is not the CSIDriver "csi.stor.io"`, 0},
		{"stor-csi driver name", "base/csi-node.yaml",
			"--driver-name=csi.stor.io", "--driver-name=stor", "base",
			`DaemonSet stor-system/stor-csi-node: stor-csi --driver-name "stor", want "csi.stor.io"`, 0},
		{"binding names a missing service account", "base/rbac-attacher.yaml",
			"    name: stor-csi-controller\n", "    name: stor-csi-controler\n", "base",
			`subject ServiceAccount stor-system/stor-csi-controler does not exist`, 2},
		{"pod names a missing service account", "base/csi-node.yaml",
			"serviceAccountName: stor-csi-node", "serviceAccountName: stor-node", "base",
			`DaemonSet stor-system/stor-csi-node: serviceAccountName "stor-node" does not exist`, 0},
		{"sidecar socket is not the driver's", "base/csi-controller.yaml",
			"csi-attacher:v4.13.0\n          args:\n            - --csi-address=/csi/csi.sock",
			"csi-attacher:v4.13.0\n          args:\n            - --csi-address=/csi/attacher.sock", "base",
			`sidecar csi-attacher: --csi-address /csi/attacher.sock, stor-csi listens on /csi/csi.sock`, 0},
		{"registration path is not the plugin dir", "base/csi-node.yaml",
			"--kubelet-registration-path=/var/lib/kubelet/plugins/csi.stor.io/csi.sock",
			"--kubelet-registration-path=/var/lib/kubelet/plugins/stor/csi.sock", "base",
			`--kubelet-registration-path /var/lib/kubelet/plugins/stor/csi.sock, but the socket is at "/var/lib/kubelet/plugins/csi.stor.io/csi.sock" on the host`, 2},
		{"argument uses an undefined variable", "base/stor-server.yaml",
			"--join=$(STOR_JOIN)", "--join=$(STOR_JOINS)", "base",
			`argument "--join=$(STOR_JOINS)" uses $(STOR_JOINS), which is not in its env`, 2},
		{"join list does not match the replicas", "overlays/multi-zone/stor-server.yaml",
			"replicas: 5", "replicas: 4", "overlays/multi-zone",
			`--join [stor-server-0.stor-server.stor-system.svc:7400 stor-server-1.stor-server.stor-system.svc:7400 stor-server-2.stor-server.stor-system.svc:7400 stor-server-3.stor-server.stor-system.svc:7400 stor-server-4.stor-server.stor-system.svc:7400], want the 4 pods`, 2},
		{"stor-server flag that does not exist", "base/stor-server.yaml",
			"--data-dir=/var/lib/stor", "--datadir=/var/lib/stor", "base",
			`container stor-server: stor-server has no flag --datadir`, 0},
		{"stor-server's Kubernetes node is its pod name", "base/stor-server.yaml",
			"--k8s-node=$(NODE_NAME)", "--k8s-node=$(POD_NAME)", "base",
			`StatefulSet stor-system/stor-server: stor-server --k8s-node=$(POD_NAME) is not $(VAR) of the pod's spec.nodeName`, 0},
		{"readiness probe on another port than --metrics-listen", "base/stor-server.yaml",
			"readinessProbe:\n            httpGet:\n              path: /readyz\n              port: metrics", "readinessProbe:\n            httpGet:\n              path: /readyz\n              port: 7400", "base",
			`stor-server readiness probe on port 7400, --metrics-listen is on 7403`, 0},
		{"liveness probe asks /readyz", "base/stor-server.yaml",
			"livenessProbe:\n            httpGet:\n              path: /healthz", "livenessProbe:\n            httpGet:\n              path: /readyz", "base",
			`stor-server liveness probe asks /readyz, want /healthz`, 0},
		{"stor-server without --metrics-listen", "base/stor-server.yaml",
			"            - --metrics-listen=0.0.0.0:7403\n", "", "base",
			`stor-server has no --metrics-listen: nothing serves /healthz and /readyz`, 0},
		{"volume mount without a volume", "overlays/hostpath-data/stor-server.yaml",
			"        - name: data\n          hostPath:", "        - name: date\n          hostPath:", "overlays/hostpath-data",
			`container stor-server mounts volume "data", which the pod does not have`, 0},
		{"node plugin mounts the whole kubelet dir", "base/csi-node.yaml",
			"            path: /var/lib/kubelet/pods\n", "            path: /var/lib/kubelet\n", "base",
			`DaemonSet stor-system/stor-csi-node: container stor-csi mounts the host's /var/lib/kubelet; mount only /var/lib/kubelet/plugins and /var/lib/kubelet/pods`, 0},
		{"provisioner with the GA Topology gate", "base/csi-controller.yaml",
			"            - --immediate-topology=false\n", "            - --immediate-topology=false\n            - --feature-gates=Topology=true\n", "base",
			`Deployment stor-system/stor-csi-controller: container csi-provisioner: --feature-gates=Topology=true: Topology is GA, the gate must not be set`, 0},
		{"provisioner cannot watch snapshots", "base/rbac-provisioner.yaml",
			`verbs: ["get", "list", "watch", "update"]`, `verbs: ["get", "list"]`, "base",
			`ClusterRole stor-external-provisioner-runner: volumesnapshots lacks [watch update] (external-provisioner watches restore sources and updates their finalizers)`, 0},
		{"CSIDriver asks for pod info", "base/csidriver.yaml",
			"podInfoOnMount: false", "podInfoOnMount: true", "base",
			`CSIDriver csi.stor.io: podInfoOnMount is true, but stor-csi uses no pod information`, 0},
		{"controller readiness on the liveness endpoint", "base/csi-controller.yaml",
			"          readinessProbe:\n            httpGet:\n              path: /readyz", "          readinessProbe:\n            httpGet:\n              path: /healthz", "base",
			`Deployment stor-system/stor-csi-controller: stor-csi readinessProbe asks /healthz on port 9897, want /readyz on --health-listen's 9897`, 0},
		{"node liveness gates on readiness", "base/csi-node.yaml",
			"              path: /healthz\n              port: 9747\n", "              path: /readyz\n              port: health\n", "base",
			`DaemonSet stor-system/stor-csi-node: stor-csi livenessProbe asks /readyz: a leaderless cluster or a recovery in progress would restart it`, 0},
		{"node startup budget too short for recovery", "base/csi-node.yaml",
			"            failureThreshold: 60\n", "            failureThreshold: 6\n", "base",
			`DaemonSet stor-system/stor-csi-node: stor-csi startupProbe gives recovery 60s (6 x 10s), want at least 300s`, 0},
		{"node plugin serves no health endpoint", "base/csi-node.yaml",
			"            - --health-listen=127.0.0.1:9746\n", "", "base",
			`DaemonSet stor-system/stor-csi-node: stor-csi has no --health-listen: nothing serves /readyz`, 4},
		// Issue 14, defect 6: the node plugin is hostNetwork, its ports are
		// host ports.
		{"node plugin in a network namespace of its own", "base/csi-node.yaml",
			"      hostNetwork: true\n", "", "base",
			`DaemonSet stor-system/stor-csi-node: the node plugin is not hostNetwork: before Linux 6.3 the nbd netlink family answers only in the host's network namespace`, 0},
		{"host-network node plugin without cluster DNS", "base/csi-node.yaml",
			"      dnsPolicy: ClusterFirstWithHostNet\n", "", "base",
			`DaemonSet stor-system/stor-csi-node: dnsPolicy "" with hostNetwork: the stor-api Service does not resolve; want ClusterFirstWithHostNet`, 0},
		{"livenessprobe on the CSI sidecars' default port", "base/csi-node.yaml",
			"9747", "9808", "base",
			`DaemonSet stor-system/stor-csi-node: container liveness-probe: port 9808 is a host port (hostNetwork) and the livenessprobe sidecar's default (EBS, GCE PD, most CSI drivers)`, 0},
		{"two containers on one host port", "base/csi-node.yaml",
			"9748", "9746", "base",
			`DaemonSet stor-system/stor-csi-node: containers stor-csi and node-driver-registrar both listen on port 9746`, 2},
		{"loopback listener probed on the node's IP", "base/csi-node.yaml",
			"              host: 127.0.0.1\n              path: /healthz\n              port: registrar\n", "              path: /healthz\n              port: registrar\n", "base",
			`DaemonSet stor-system/stor-csi-node: container node-driver-registrar: livenessProbe on port 9748 asks host ""; node-driver-registrar listens on 127.0.0.1 only (want host: 127.0.0.1)`, 0},
		{"livenessprobe on every address of the node", "base/csi-node.yaml",
			"--http-endpoint=127.0.0.1:9747", "--http-endpoint=:9747", "base",
			`DaemonSet stor-system/stor-csi-node: container liveness-probe: --http-endpoint listens on "":9747, every address of the node (hostNetwork); bind 127.0.0.1`, 0},
		{"host port not declared", "base/csi-node.yaml",
			"          ports:\n            - name: healthz\n              containerPort: 9747\n              hostPort: 9747\n", "", "base",
			`DaemonSet stor-system/stor-csi-node: container liveness-probe listens on port 9747 (--http-endpoint) but does not declare it: the scheduler cannot see the host port`, 0},
		{"host port not said", "base/csi-node.yaml",
			"              containerPort: 9748\n              hostPort: 9748\n", "              containerPort: 9748\n", "base",
			`DaemonSet stor-system/stor-csi-node: container node-driver-registrar: port 9748 has hostPort 0; with hostNetwork it is a host port, say so (hostPort 9748)`, 0},
		{"controller given a node flag", "base/csi-controller.yaml",
			"            - --servers=stor-api:7400\n", "            - --servers=stor-api:7400\n            - --state-dir=/var/lib/stor-csi\n", "base",
			`Deployment stor-system/stor-csi-controller: container stor-csi: stor-csi --mode=controller is given --state-dir=/var/lib/stor-csi, a node flag it refuses`, 0},
		{"node plugin memory limit above its request", "base/csi-node.yaml",
			"            limits:\n              memory: 512Mi\n", "            limits:\n              memory: 1Gi\n", "base",
			`DaemonSet stor-system/stor-csi-node: container stor-csi: memory request 512Mi, limit 1Gi: the node plugin serves its node's writeback, want both set and equal`, 0},
		{"node plugin CPU limit", "base/csi-node.yaml",
			"            limits:\n              memory: 512Mi\n", "            limits:\n              memory: 512Mi\n              cpu: 500m\n", "base",
			`DaemonSet stor-system/stor-csi-node: container stor-csi: CPU limit 500m: a throttled NBD server stalls every volume of the node`, 0},
		{"stor-csi image points at a registry", "base/kustomization.yaml",
			"    newName: stor-csi\n", "    newName: ghcr.io/stor-io/stor-csi\n", "base",
			`DaemonSet stor-system/stor-csi-node: container stor-csi: image ghcr.io/stor-io/stor-csi:dev, want the placeholder stor-csi:dev`, 4},
		{"example claim uses a class the base lacks", "examples/pvc-pod.yaml",
			"storageClassName: stor\n", "storageClassName: stor-fast\n", "examples",
			`storageClassName "stor-fast" is not a StorageClass of the base`, 0},
		{"misspelled example field", "examples/raw-block.yaml",
			"volumeDevices:", "volumeDevice:", "examples",
			`unknown field "spec.containers[0].volumeDevice"`, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mem := copyToMemory(t)
			file := "/kubernetes/" + tc.file
			data, err := mem.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(data), tc.old) {
				t.Fatalf("%s does not contain %q any more: update this case", tc.file, tc.old)
			}
			if err := mem.WriteFile(file, []byte(strings.ReplaceAll(string(data), tc.old, tc.new))); err != nil {
				t.Fatal(err)
			}
			var errs []error
			if tc.render == "examples" {
				base, berrs := validate(mem, "/kubernetes/base", flags)
				if len(berrs) > 0 {
					t.Fatalf("base: %v", berrs)
				}
				_, errs = validateExamples(mem, "/"+examplesDir, base)
			} else {
				_, errs = validate(mem, "/kubernetes/"+tc.render, flags)
			}
			want := max(tc.count, 1)
			matched := slices.IndexFunc(errs, func(err error) bool { return strings.Contains(err.Error(), tc.want) })
			if len(errs) != want || matched < 0 {
				t.Errorf("got %d error(s), want %d containing %q:", len(errs), want, tc.want)
				for _, err := range errs {
					t.Errorf("  %v", err)
				}
				return
			}
			t.Logf("caught: %v", errs[matched])
		})
	}
}
