// Package deploy holds what a cluster operator applies to run stor on
// Kubernetes, and the test that keeps it honest. It has no Go API: the
// package exists for its tests.
//
//	kubernetes/base                  kustomize base: namespace stor-system, the
//	                                 stor-server StatefulSet (3) with its Services
//	                                 and PodDisruptionBudget, the CSI controller
//	                                 Deployment and node DaemonSet with their
//	                                 sidecars, CSIDriver, StorageClass,
//	                                 VolumeSnapshotClass, RBAC per sidecar
//	kubernetes/overlays/multi-zone   5 servers, 5 voters, hard zone spread
//	kubernetes/overlays/hostpath-data  the servers' data in a host directory
//	kubernetes/examples              a PVC and pod, a snapshot and restore,
//	                                 a raw block PVC
//	images/                          Dockerfiles over the static binaries of
//	                                 make image-binaries; node-zone (the init
//	                                 container that reads a node's zone)
//	monitoring/                      a PrometheusRule (no leader, server down,
//	                                 replicas faulty, capacity, disk full) and a
//	                                 Grafana dashboard on stor's metrics
//
// The tests render the base and every overlay with kustomize's krusty (no
// kubectl needed), decode every object strictly into the Kubernetes types
// of k8s.io/client-go's scheme and the VolumeSnapshot v1 types (an unknown
// field or kind fails), and check the cross-references a typo would break:
// the driver name everywhere, service accounts and roles that exist, the
// CSI socket shared by the driver and each sidecar, the kubelet
// registration path, environment variables used in arguments, volumes
// mounted, probe ports, the node plugin's host network (hostNetwork with
// ClusterFirstWithHostNet DNS; every listening port declared as a host
// port on loopback, probed on 127.0.0.1, none a well-known port of another
// CSI driver or node agent, none shared), the storage servers' --join
// list against the StatefulSet's size, stor-server's --k8s-node from the
// pod's spec.nodeName (data locality), and the flags passed to
// stor-server against its flag set. Another test feeds deliberately broken copies through the
// same checks and asserts each is caught with the expected message; another
// runs node-zone against a fake API server; another checks that the
// alerts and the dashboard in monitoring/ query only series stor's
// collectors (internal/metrics) publish.
package deploy
