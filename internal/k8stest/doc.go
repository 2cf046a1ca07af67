// Package k8stest runs stor against a real Kubernetes control plane:
// etcd, kube-apiserver (real certificates, RBAC and Node authorization),
// kube-controller-manager and kube-scheduler at v1.37.2, and the CSI
// sidecars at the tags deploy/ pins, all built from the tools modules
// under tools/k8s by scripts/k8s-tools.sh (make k8s). Nothing here is
// in stor's own go.mod but client-go.
//
// What is real and what is not:
//
//   - The control plane is the real one, as processes, with the
//     controllers a cluster runs (attach/detach, persistent volume
//     binder and expander, node lifecycle, pod GC) and the real
//     scheduler's VolumeBinding with CSIStorageCapacity.
//   - deploy/'s base is applied as rendered. The sidecars and
//     stor-csi --mode=controller run as processes with the arguments the
//     rendered Deployment gives them ($(VAR) expanded from the pod, as the
//     kubelet does) and a token of the ServiceAccount deploy/ binds, so
//     deploy/'s RBAC is what is tested. Only addresses change: the socket
//     path (a temp dir for /csi), stor-api:7400 (the servers' loopback
//     addresses), health ports (one free port each), Secret volumes (a
//     directory of the Secret's keys, named in place of the mount path),
//     and --kubeconfig (out of cluster).
//   - cert-manager is not run: a stand-in (certmanager.go) with CRDs that
//     accept any spec issues deploy/'s Certificates from its Issuers into
//     their Secrets, with the stor cluster's CA. Everything speaks mutual
//     TLS: stor-csi --mode=controller with deploy/'s certificate, the node
//     plugins as csi-node/<node>, the test as the operator.
//   - Nodes are fake kubelets (Kubelet): each registers its Node and
//     keeps its Lease, writes its CSINode and topology labels from the
//     node plugin's NodeGetInfo as the kubelet does once the registrar
//     registers the driver, marks the pods bound to it Running, and
//     drives the node plugin over CSI in the kubelet's order (stage,
//     publish, expand, unpublish, unstage), reporting volumesInUse.
//   - The node plugins are stor-csi drivers in this process with a fake
//     kernel (this machine has no nbd): the engine, the attachment rules
//     and the cluster calls are real, the block device is not. The
//     kernel path is make vm's.
//   - The stor servers are an in-process cluster (servertest, with TLS),
//     one per node, with --k8s-node set to that node; deploy/'s
//     StatefulSet is applied but its pods are not run (its self-issued
//     certificates are tested by internal/e2etest).
package k8stest
