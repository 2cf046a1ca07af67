package k8stest

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	storpki "github.com/stor-io/stor/internal/pki"
)

// cert-manager is deploy/'s prerequisite for certificates (tls.yaml), and
// nothing here can run it. The tier stands in for it: CertManagerCRDs are
// CRDs of cert-manager.io/v1 Issuer and Certificate that accept any spec
// (cert-manager's own schemas are not fetched), and IssueCertificates does
// what cert-manager's controller would do with deploy/'s objects: for each
// Certificate, follow its issuerRef to an Issuer (selfSigned, or ca with a
// Secret made by an isCA Certificate) and write the Secret secretName with
// tls.crt, tls.key and ca.crt. The CA is the stack's stor cluster's CA
// (servertest's), so the in-process servers and the processes run from
// deploy/'s pods trust each other. Only the fields below are understood;
// deploy's tests decode its cert-manager objects strictly into these types,
// so a field deploy/ uses and this stand-in ignores fails there.

// CertManagerGroupVersion is cert-manager's API group and version.
var CertManagerGroupVersion = schema.GroupVersion{Group: "cert-manager.io", Version: "v1"}

// Certificate is the part of a cert-manager.io/v1 Certificate deploy/ uses.
type Certificate struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              CertificateSpec `json:"spec"`
}

// CertificateSpec: see cert-manager's API reference for each field.
type CertificateSpec struct {
	SecretName  string            `json:"secretName"`
	IsCA        bool              `json:"isCA,omitempty"`
	CommonName  string            `json:"commonName,omitempty"`
	URIs        []string          `json:"uris,omitempty"`
	Usages      []string          `json:"usages,omitempty"`
	Duration    string            `json:"duration,omitempty"`
	RenewBefore string            `json:"renewBefore,omitempty"`
	PrivateKey  *CertificateKey   `json:"privateKey,omitempty"`
	IssuerRef   CertificateIssuer `json:"issuerRef"`
}

// CertificateKey is a Certificate's privateKey.
type CertificateKey struct {
	Algorithm      string `json:"algorithm,omitempty"`
	Size           int    `json:"size,omitempty"`
	RotationPolicy string `json:"rotationPolicy,omitempty"`
}

// CertificateIssuer is a Certificate's issuerRef.
type CertificateIssuer struct {
	Name  string `json:"name"`
	Kind  string `json:"kind,omitempty"`
	Group string `json:"group,omitempty"`
}

// Issuer is the part of a cert-manager.io/v1 Issuer deploy/ uses.
type Issuer struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              IssuerSpec `json:"spec"`
}

// IssuerSpec: a self-signed issuer or a CA issuer.
type IssuerSpec struct {
	SelfSigned *struct{} `json:"selfSigned,omitempty"`
	CA         *IssuerCA `json:"ca,omitempty"`
}

// IssuerCA is an Issuer's ca.
type IssuerCA struct {
	SecretName string `json:"secretName"`
}

func (c *Certificate) DeepCopyObject() runtime.Object { return deepCopy(c, &Certificate{}) }
func (i *Issuer) DeepCopyObject() runtime.Object      { return deepCopy(i, &Issuer{}) }

func deepCopy[T runtime.Object](in, out T) runtime.Object {
	b, err := json.Marshal(in)
	if err != nil {
		panic(err)
	}
	if err := json.Unmarshal(b, out); err != nil {
		panic(err)
	}
	return out
}

// AddCertManagerToScheme registers Certificate and Issuer.
func AddCertManagerToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(CertManagerGroupVersion, &Certificate{}, &Issuer{})
	return nil
}

// certManagerCRDs are the stand-in CRDs (see above).
func certManagerCRDs() [][]byte {
	var out [][]byte
	for _, k := range []struct{ kind, plural string }{{"Issuer", "issuers"}, {"Certificate", "certificates"}} {
		out = append(out, []byte(fmt.Sprintf(`apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: %[2]s.cert-manager.io
spec:
  group: cert-manager.io
  scope: Namespaced
  names: {kind: %[1]s, plural: %[2]s, singular: %[3]s, listKind: %[1]sList}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
`, k.kind, k.plural, k.plural[:len(k.plural)-1])))
	}
	return out
}

// issueCertificates writes the Secret of every Certificate in Namespace,
// as cert-manager would (see above), with the stor cluster's CA.
func (s *Stack) issueCertificates(ctx context.Context) {
	s.t.Helper()
	get := func(resource string, into any) {
		l, err := s.CP.Dynamic.Resource(CertManagerGroupVersion.WithResource(resource)).Namespace(Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			s.t.Fatalf("k8stest: cert-manager stand-in: list %s: %v", resource, err)
		}
		b, err := json.Marshal(l.Items)
		if err != nil {
			s.t.Fatal(err)
		}
		if err := json.Unmarshal(b, into); err != nil {
			s.t.Fatalf("k8stest: cert-manager stand-in: %s: %v", resource, err)
		}
	}
	var certs []Certificate
	var issuers []Issuer
	get("certificates", &certs)
	get("issuers", &issuers)
	issuer := map[string]Issuer{}
	for _, i := range issuers {
		issuer[i.Name] = i
	}
	caSecret := map[string]bool{} // Secrets that hold a CA (made by an isCA Certificate)
	for _, c := range certs {
		if c.Spec.IsCA {
			caSecret[c.Spec.SecretName] = true
		}
	}
	caCert, err := os.ReadFile(filepath.Join(s.Stor.TLSDir(), "ca.crt"))
	if err != nil {
		s.t.Fatal(err)
	}
	caKey, err := os.ReadFile(filepath.Join(s.Stor.TLSDir(), "ca.key"))
	if err != nil {
		s.t.Fatal(err)
	}
	for _, c := range certs {
		is, ok := issuer[c.Spec.IssuerRef.Name]
		if !ok || (c.Spec.IssuerRef.Kind != "" && c.Spec.IssuerRef.Kind != "Issuer") {
			s.t.Fatalf("k8stest: Certificate %s: issuerRef %+v names no Issuer in %s", c.Name, c.Spec.IssuerRef, Namespace)
		}
		data := map[string][]byte{"ca.crt": caCert}
		switch {
		case c.Spec.IsCA && is.Spec.SelfSigned != nil:
			data["tls.crt"], data["tls.key"] = caCert, caKey
		case !c.Spec.IsCA && is.Spec.CA != nil && caSecret[is.Spec.CA.SecretName]:
			if len(c.Spec.URIs) != 1 {
				s.t.Fatalf("k8stest: Certificate %s: %d URI SANs, want one stor:// identity", c.Name, len(c.Spec.URIs))
			}
			u, err := url.Parse(c.Spec.URIs[0])
			if err != nil {
				s.t.Fatal(err)
			}
			id, err := storpki.ParseIdentity(u)
			if err != nil {
				s.t.Fatalf("k8stest: Certificate %s: %v", c.Name, err)
			}
			f := s.Stor.TLSFiles(id)
			if data["tls.crt"], err = os.ReadFile(f.Cert); err != nil {
				s.t.Fatal(err)
			}
			if data["tls.key"], err = os.ReadFile(f.Key); err != nil {
				s.t.Fatal(err)
			}
		default:
			s.t.Fatalf("k8stest: Certificate %s (isCA %v) from Issuer %s: not a chain this stand-in (or cert-manager) makes", c.Name, c.Spec.IsCA, is.Name)
		}
		sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: c.Spec.SecretName, Namespace: Namespace}, Type: corev1.SecretTypeTLS, Data: data}
		if _, err := s.CP.Client.CoreV1().Secrets(Namespace).Create(ctx, sec, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			s.t.Fatalf("k8stest: Secret %s: %v", sec.Name, err)
		}
	}
}
