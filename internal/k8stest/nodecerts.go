package k8stest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/nodecert"
	storpki "github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/server"
)

// The node plugins get their certificates as deploy/'s csi-node pods do
// (csi-node.yaml): with the bootstrap certificate of tls.yaml (the
// Secret the cert-manager stand-in made) and a token of the
// stor-csi-node ServiceAccount, audience stor, bound to the DaemonSet's
// pod on that node, the plugin asks the stor servers for
// stor://csi-node/<node>; the servers have the real API server review the
// token, as deploy/'s stor-server ServiceAccount (rbac-server.yaml), and
// take the node from the review.

// nodeServiceAccount is deploy/'s node plugin ServiceAccount, as a user.
const nodeServiceAccount = "system:serviceaccount:" + Namespace + ":stor-csi-node"

// lazyReviewer reviews tokens with a token of deploy/'s stor-server
// ServiceAccount, made at the first review (the servers start before
// deploy/ is applied).
type lazyReviewer struct {
	s    *Stack
	once sync.Once
	r    server.TokenReviewer
	err  error
}

func (l *lazyReviewer) Review(ctx context.Context, token string) (server.TokenReview, error) {
	l.once.Do(func() {
		tok, err := l.s.CP.Client.CoreV1().ServiceAccounts(Namespace).CreateToken(ctx, "stor-server",
			&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600)}}, metav1.CreateOptions{})
		if err != nil {
			l.err = fmt.Errorf("k8stest: a token of stor-server: %w", err)
			return
		}
		cfg, err := clientcmd.BuildConfigFromFlags("", l.s.CP.TokenKubeconfig("sa-stor-server", tok.Status.Token))
		if err != nil {
			l.err = err
			return
		}
		l.r, l.err = server.NewKubeTokenReviewerFor(cfg)
	})
	if l.err != nil {
		return server.TokenReview{}, l.err
	}
	return l.r.Review(ctx, token)
}

// NodePluginPod waits for the stor-csi-node pod on node and returns it.
func (s *Stack) NodePluginPod(ctx context.Context, node string) (*corev1.Pod, error) {
	var pod *corev1.Pod
	err := poll(ctx, func() error {
		l, err := s.CP.Client.CoreV1().Pods(Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=stor-csi-node"})
		if err != nil {
			return err
		}
		for i, p := range l.Items {
			if p.Spec.NodeName == node && p.DeletionTimestamp == nil {
				pod = &l.Items[i]
				return nil
			}
		}
		return fmt.Errorf("no stor-csi-node pod on node %s yet", node)
	})
	return pod, err
}

// PodToken is a token of pod's ServiceAccount bound to pod, for
// audiences (none: the API server's), as the kubelet projects it.
func (s *Stack) PodToken(ctx context.Context, pod *corev1.Pod, audiences ...string) (string, error) {
	tok, err := s.CP.Client.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(ctx, pod.Spec.ServiceAccountName, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{Audiences: audiences, ExpirationSeconds: ptr.To[int64](3600),
			BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}},
	}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("token of pod %s: %w", pod.Name, err)
	}
	return tok.Status.Token, nil
}

// BootstrapClient is a client of the stor servers with the node plugins'
// bootstrap certificate (the Secret pod mounts as its volume
// "bootstrap"), whose files are written to dir.
func (s *Stack) BootstrapClient(ctx context.Context, pod *corev1.Pod, dir string) (*client.Client, error) {
	var secretName string
	for _, v := range pod.Spec.Volumes {
		if v.Name == "bootstrap" && v.Secret != nil {
			secretName = v.Secret.SecretName
		}
	}
	sec, err := s.CP.Client.CoreV1().Secrets(Namespace).Get(ctx, secretName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("the node plugin's bootstrap Secret %q: %w", secretName, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	for k, v := range sec.Data {
		if err := os.WriteFile(filepath.Join(dir, k), v, 0o400); err != nil && !os.IsExist(err) {
			return nil, err
		}
	}
	src, err := storpki.Load(storpki.Files{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), CA: filepath.Join(dir, "ca.crt")}, s.log)
	if err != nil {
		return nil, err
	}
	cl, err := client.Dial(strings.Split(s.ServerAddrs(), ","), src.GRPCDialCredentials())
	if err != nil {
		return nil, err
	}
	s.t.Cleanup(func() { cl.Close() })
	return cl, nil
}

// nodeCredentials obtains node's certificate into dir/tls as its node
// plugin pod would, keeps it renewed until the test ends, and returns it.
func (s *Stack) nodeCredentials(ctx context.Context, node, dir string) (*storpki.Source, error) {
	pod, err := s.NodePluginPod(ctx, node)
	if err != nil {
		return nil, err
	}
	tok, err := s.PodToken(ctx, pod, "stor")
	if err != nil {
		return nil, err
	}
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(tok), 0o600); err != nil {
		return nil, err
	}
	cl, err := s.BootstrapClient(ctx, pod, filepath.Join(dir, "bootstrap"))
	if err != nil {
		return nil, err
	}
	b, err := nodecert.New(nodecert.Config{NodeID: node, Dir: filepath.Join(dir, "tls"), TokenFile: tokenFile, Issuer: cl.Cluster, Logger: s.log})
	if err != nil {
		return nil, err
	}
	if err := b.Ensure(ctx); err != nil {
		return nil, err
	}
	rctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = b.Run(rctx) }()
	s.t.Cleanup(func() { cancel(); <-done })
	return storpki.Load(b.Files(), s.log)
}
